"""The SLO planner's loop in the controller: every `autoscale.interval_seconds` it reads the
router's latencies and the replicas' engine stats into a snapshot, asks the planner
(orchestrator/planner.py) what to do, records the decision (log, /metrics, `status`) and, in
`mode: act`, carries it out through the controller's own scale-and-drain path. A move (the budget
is reached) drains a replica of one role first, then starts one of the other.

Ray keeps an actor whose resources exist but are taken (other actors' CPUs, a GPU in use) pending
for as long as they are, and the planner waits for its last change to land before the next: a
replica the planner added that is not ready after `autoscale.start_timeout_seconds` is scaled away
again, and its role counts as unplaceable for one cooldown (reported once), then may grow again."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from pdcluster.config import AutoscaleSection
from pdcluster.orchestrator.planner import ROLES, Decision, Limits, Planner, RoleView, Snapshot
from pdcluster.orchestrator.replicas import ReplicaState

if TYPE_CHECKING:
    from pdcluster.orchestrator.controller import Controller

logger = logging.getLogger(__name__)


class NoRouter(Exception):
    """The router died and its replacement does not serve yet: no latencies to decide by."""


def limits(section: AutoscaleSection) -> Limits:
    return Limits(
        ttft_p90_s=section.ttft_p90_ms / 1e3,
        itl_p90_s=section.itl_p90_ms / 1e3,
        min_replicas={role: getattr(section, role).min for role in ROLES},
        max_replicas={role: getattr(section, role).max for role in ROLES},
        budget=section.total_budget(),
        # the window must have turned over since the last change landed, or its p90 still holds
        # the old size's latencies: a cooldown shorter than the window acts on them again
        cooldown_s=max(section.cooldown_seconds, section.window_seconds),
        hysteresis=section.hysteresis,
        margin=section.margin,
        kv_high=section.kv_high,
    )


class PlannerLoop:
    def __init__(self, controller: Controller):
        self.controller = controller
        self.section = controller.config.autoscale
        self.planner = Planner(limits(self.section))
        self.last: dict[str, Any] | None = None  # the latest decision that was not a plain hold
        self._task: asyncio.Task | None = None
        self._added: dict[str, tuple[float, set[str]]] = {}  # role -> when and which replicas it last added
        self._held: dict[str, tuple[float, str]] = {}  # role -> until when, and why, it may not grow

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        import ray

        while True:
            await asyncio.sleep(self.section.interval_seconds)  # the planner's interval
            try:
                await self.give_up_unstarted(time.monotonic())
                decision = self.planner.decide(await self.snapshot())
                await self.apply(decision)
            except (ray.exceptions.RayError, asyncio.TimeoutError, NoRouter) as exc:
                logger.warning("planner: this interval's decision was skipped (%s: %s)", type(exc).__name__, exc)
            except Exception:  # noqa: BLE001 - a task nobody awaits: anything else ended autoscaling for good
                logger.exception("planner: this interval's decision failed; deciding again next interval")

    async def snapshot(self) -> Snapshot:
        router = self.controller.router
        if router is None:
            raise NoRouter("no router serves now: a new one is starting (router_keeper.py)")
        slo = await router.slo.remote()
        roles, actual, now = {}, self.actual(), time.monotonic()
        for role in ROLES:
            pool = self.controller.pools[role]
            ready = [r for r in pool if r.state == ReplicaState.READY]
            stats = [(r.info or {}).get("stats") or {} for r in ready]
            roles[role] = RoleView(
                ready=len(ready),
                starting=sum(r.state == ReplicaState.STARTING for r in pool),
                draining=sum(r.state == ReplicaState.DRAINING for r in pool),
                waiting=sum(s.get("waiting", 0) for s in stats),
                running=sum(s.get("running", 0) for s in stats),
                kv_usage=max((s.get("kv_cache_usage", 0.0) for s in stats), default=0.0),
                unplaceable=self.unplaceable(role, actual[role], now),
            )
        return Snapshot(now, slo["ttft"], slo["itl"], slo["phase"], roles)

    async def give_up_unstarted(self, now: float) -> None:
        """Scale away the replicas the planner added that are still starting `start_timeout_seconds`
        after it asked for them; their role may not grow for a cooldown."""
        for role, (asked_at, added) in list(self._added.items()):
            pending = [
                r for r in self.controller.pools[role] if r.replica_id in added and r.state == ReplicaState.STARTING
            ]
            if pending and now - asked_at < self.section.start_timeout_seconds:
                continue
            del self._added[role]
            if not pending:
                continue  # it landed, or left otherwise
            names = ", ".join(f"{r.replica_id} ({r.stage})" for r in pending)
            why = f"{names} not ready {self.section.start_timeout_seconds:.0f} s after the planner added it"
            self._held[role] = (now + self.planner.limits.cooldown_s, why)
            logger.warning(
                "planner: %s; scaling it away, %s may grow again in %.0f s", why, role, self.planner.limits.cooldown_s
            )
            # These replicas, not the newest starting ones (a replacement started since may be newer).
            await self.controller.resize(role, self.actual()[role] - len(pending), {r.replica_id for r in pending})

    def unplaceable(self, role: str, active: int, now: float) -> str:
        """Why another replica of `role` cannot start ("": it can). On CPU a role's cpu_bind is
        its pool of cores: the planner starts a replica only onto an entry no replica holds."""
        until, why = self._held.get(role, (0.0, ""))
        if now < until:
            return why
        cores = self.controller.config.role(role).cpu_bind
        if cores and active >= len(cores):
            return f"no free core in roles.{role}.cpu_bind ({len(cores)} entries, {active} replicas)"
        if not self.controller._placeable(role):
            return f"no node can place a {role} replica ({self.controller.unplaced.get(role, '')})"
        return ""

    def actual(self) -> dict[str, int]:
        active = (ReplicaState.STARTING, ReplicaState.READY)
        return {role: sum(r.state in active for r in self.controller.pools[role]) for role in ROLES}

    async def apply(self, decision: Decision) -> None:
        record = {
            "rule": decision.rule,
            "role": decision.role,
            "reason": decision.reason,
            "actions": [list(a) for a in decision.actions],
            "desired": decision.desired,
            "actual": self.actual(),
            "mode": self.section.mode,
            "at": time.time(),
        }
        if self.controller.router is not None:  # (None: being replaced)
            await self.controller.router.planner.remote(record)
        if decision.rule == "hold" and not decision.actions:
            if self.last is None or self.last["rule"] == "hold":
                self.last = record
            return
        self.last = record
        logger.info("planner (%s): %s %s: %s", self.section.mode, decision.rule, decision.actions, decision.reason)
        if self.section.mode != "act":
            return
        for role, action in decision.actions:
            size = self.actual()[role]
            result = await self.controller.resize(role, size + 1 if action == "add" else size - 1)
            if action == "add":
                self._added[role] = (time.monotonic(), set(result["added"]))
            if action == "remove" and len(decision.actions) > 1:
                await self._drained(role)  # a move: the budget holds while the drained one stops

    async def _drained(self, role: str) -> None:
        while any(r.state == ReplicaState.DRAINING for r in self.controller.pools[role]):
            await asyncio.sleep(1.0)  # re-checked after the monitor's next refresh
