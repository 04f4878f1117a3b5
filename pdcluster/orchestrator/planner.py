"""SLO planner: from a metrics snapshot to scaling actions, for `autoscale:` in the cluster YAML.

Pure (no Ray, no clock of its own), so every rule is tested on synthetic snapshots
(tests/unit/test_planner.py); the controller's loop builds a snapshot every interval, calls
`Planner.decide`, and acts through its own scale-and-drain path (`mode: act`) or only logs and
exposes the decision (`mode: advise`).

Signals, each over the router's window: TTFT p90 and ITL p90 (what streaming clients saw; for
P/D answers sent whole, the server's view), the prefill phase p90 (prefill replicas' own share
of TTFT); per role: requests waiting in the engines, KV
cache usage (the highest replica's), and replicas ready / starting / draining.

Rules, in order (the first that holds for `hysteresis` intervals in a row acts):
  1. prefill: TTFT p90 misses its target while prompts queue on prefill (a prefill engine has
     waiting requests, or the prefill phase alone takes half the TTFT target or more), or with
     no prefill replica (decode computes the prompts): add one.
  2. decode: ITL p90 misses its target, or decode KV usage reaches `kv_high`: add one.
  3. both targets met with margin (p90 ≤ (1 - margin) x target; no traffic counts as met):
     remove one from the role with more slack, never below its min.
A role at its max stays there. A role that must grow while the replicas add up to the budget
takes one from the other role when that role is above its min and its own target is met with
margin: the planner drains one there, then starts one here ("move"). Nothing acts within
`cooldown` of the last action landing (its replica ready or gone: the window then holds samples
of the new size; a cooldown shorter than the window counts as the window, autoscale.limits), nor while a replica is still starting or draining, and a role no node can place
is reported, not retried in a loop. A rule held by a bound (a role at its max, the budget) lets
the next rule act.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
PREFILL_SHARE = 0.5  # the prefill phase taking this share of the TTFT target: prompts queue there


@dataclass(frozen=True)
class RoleView:
    ready: int = 0
    starting: int = 0
    draining: int = 0
    waiting: int = 0  # requests queued in the role's engines
    running: int = 0  # requests being computed in the role's engines
    kv_usage: float = 0.0  # the highest replica's KV cache usage, 0..1
    unplaceable: str = ""  # why no node (or no free core) can take one more replica ("": one can)

    @property
    def settling(self) -> bool:
        return bool(self.starting or self.draining)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


@dataclass(frozen=True)
class Snapshot:
    now: float  # seconds, any monotonic clock
    ttft_p90_s: float | None
    itl_p90_s: float | None
    prefill_phase_p90_s: float | None
    roles: dict[str, RoleView]


@dataclass(frozen=True)
class Limits:
    """`autoscale:` of the cluster YAML, as the planner reads it."""

    ttft_p90_s: float
    itl_p90_s: float
    min_replicas: dict[str, int]
    max_replicas: dict[str, int]
    budget: int  # replicas of both roles together
    cooldown_s: float = 60.0
    hysteresis: int = 3  # intervals in a row a rule must hold before it acts
    margin: float = 0.3  # "met with margin": p90 ≤ (1 - margin) x target
    kv_high: float = 0.9


@dataclass(frozen=True)
class Decision:
    """What the planner wants now: `actions` in order (a move is remove then add), why (`reason`,
    one line), and the rule (`add_prefill`, `add_decode`, `remove`, `hold`, ...)."""

    rule: str
    reason: str
    actions: tuple[tuple[str, str], ...] = ()  # (role, "add" | "remove")
    desired: dict[str, int] = field(default_factory=dict)
    role: str = ""  # the role the rule is about ("" when none is)
    blocked: bool = False  # a hold by a bound (max, budget): the next rule may still act


@dataclass
class Planner:
    limits: Limits
    last_action_at: float = float("-inf")
    streaks: dict[str, int] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)  # unplaceable roles told once
    # The last snapshot with a replica starting or draining: the cooldown counts from when the
    # last change landed, not from when it was asked for (a start may outlast the cooldown).
    settling_seen_at: float = float("-inf")

    def decide(self, snap: Snapshot) -> Decision:
        lim = self.limits
        size = {role: snap.roles[role].ready + snap.roles[role].starting for role in ROLES}
        ttft_miss = snap.ttft_p90_s is not None and snap.ttft_p90_s > lim.ttft_p90_s
        # With no prefill replica decode computes every prompt: a TTFT miss is prefill work too.
        prefill_queues = (
            size["prefill"] == 0
            or snap.roles["prefill"].waiting > 0
            or (snap.prefill_phase_p90_s is not None and snap.prefill_phase_p90_s >= PREFILL_SHARE * lim.ttft_p90_s)
        )
        itl_miss = snap.itl_p90_s is not None and snap.itl_p90_s > lim.itl_p90_s
        kv_full = snap.roles["decode"].kv_usage >= lim.kv_high
        # A window without samples is idle only where nothing is in flight: prompts queued past
        # the window on an overloaded prefill have no first token yet, so no TTFT to show.
        busy = snap.roles["prefill"].busy or snap.roles["decode"].busy
        slack = {
            "prefill": _slack(snap.ttft_p90_s, lim.ttft_p90_s, lim.margin, busy),
            "decode": None if kv_full else _slack(snap.itl_p90_s, lim.itl_p90_s, lim.margin, snap.roles["decode"].busy),
        }
        candidates = []
        if ttft_miss and prefill_queues:
            candidates.append(
                (
                    "add_prefill",
                    "prefill",
                    f"TTFT p90 {_ms(snap.ttft_p90_s)} > {_ms(lim.ttft_p90_s)} with prompts queued on prefill",
                )
            )
        if itl_miss or kv_full:
            why = (
                f"ITL p90 {_ms(snap.itl_p90_s)} > {_ms(lim.itl_p90_s)}"
                if itl_miss
                else f"decode KV usage {snap.roles['decode'].kv_usage:.0%}"
            )
            candidates.append(("add_decode", "decode", why))
        if not candidates and slack["prefill"] is not None and slack["decode"] is not None:
            candidates.append(("remove", max(ROLES, key=lambda r: (slack[r], size[r])), "both targets met with margin"))
        fired = {rule for rule, _, _ in candidates}
        self.streaks = {rule: self.streaks.get(rule, 0) + 1 for rule in fired}
        desired = dict(size)
        if any(v.settling for v in snap.roles.values()):
            self.settling_seen_at = snap.now
        bound: Decision | None = None
        for rule, role, why in candidates:
            if self.streaks[rule] < lim.hysteresis:
                continue
            decision = self._act(snap, rule, role, why, size, slack, desired)
            if decision is not None and decision.blocked:
                bound = bound or decision  # the next rule may still act (a prefill at its max: add decode)
            elif decision is not None:
                return decision
        return bound or Decision("hold", _holding(candidates, self.streaks, lim.hysteresis), desired=desired)

    def _act(self, snap, rule, role, why, size, slack, desired) -> Decision | None:
        lim = self.limits
        other = "decode" if role == "prefill" else "prefill"
        if rule == "remove":
            if size[role] <= lim.min_replicas[role]:
                role, other = other, role
                if size[role] <= lim.min_replicas[role]:
                    return None
            actions = ((role, "remove"),)
        elif size[role] >= lim.max_replicas[role]:
            return Decision(
                "hold", f"{why}, but {role} is at its max ({lim.max_replicas[role]})", desired=desired, blocked=True
            )
        elif sum(size.values()) < lim.budget:
            actions = ((role, "add"),)
        elif size[other] > lim.min_replicas[other] and slack[other] is not None:
            actions, rule = ((other, "remove"), (role, "add")), f"move_to_{role}"
            why += f"; budget of {lim.budget} reached, {other} has slack"
        else:
            return Decision("hold", f"{why}, but the budget of {lim.budget} is reached", desired=desired, blocked=True)
        if any(act == "add" and snap.roles[r].unplaceable for r, act in actions):
            first = role not in self.reported
            self.reported.add(role)
            if not first:
                return None
            return Decision("unplaceable", f"{why}, but {snap.roles[role].unplaceable}", (), desired, role)
        self.reported.discard(role)
        for r, act in actions:
            desired[r] += 1 if act == "add" else -1
        if any(v.settling for v in snap.roles.values()):
            return Decision("hold", f"{why}; waiting for the last change to land", desired=desired)
        if snap.now - max(self.last_action_at, self.settling_seen_at) < lim.cooldown_s:
            return Decision("hold", f"{why}; cooling down", desired=desired)
        self.last_action_at = snap.now
        self.streaks.clear()
        return Decision(rule, why, actions, desired, role)


def _slack(p90: float | None, target: float, margin: float, busy: bool) -> float | None:
    """How far under its target a signal is, as a share of the target (None: not met with margin,
    or unknown: no sample in the window while requests are in flight)."""
    if p90 is None:
        return None if busy else 1.0  # idle: nothing missed
    share = 1.0 - p90 / target
    return share if share >= margin else None


def _holding(candidates, streaks, hysteresis) -> str:
    if not candidates:
        return "targets met"
    rule, _, why = candidates[0]
    return f"{why} ({streaks[rule]}/{hysteresis} intervals)"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"
