"""How the controller holds each role at its configured size: which replica slots to (re)start,
when a replica counts as dead, and how often a slot may be restarted. Pure (no Ray), so the
rules are tested on their own (tests/unit/test_reconcile.py); the controller applies them.

A role of N replicas has slots 0..N-1 (a scale-up adds the lowest free ones; where the role binds
cores, `cpu_bind`, a slot whose cores no replica holds, draining ones included, comes first). A
replica that dies or fails to start leaves its slot empty; the controller's monitor refills empty
slots on every tick, each slot at most MAX_RESTARTS times per RESTART_WINDOW_S and with a growing pause between
restarts (RESTART_BACKOFF_S), so a replica that cannot start is retried later instead of never,
and one that fails at once does not loop.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

HEALTH_FAILURES = 3  # consecutive timed-out health checks before a replica is declared dead
RESTART_WINDOW_S = 300.0
MAX_RESTARTS = 5  # restarts per slot within the window (its first start not counted)
RESTART_BACKOFF_S = (0.0, 5.0, 15.0, 30.0, 60.0)  # pause before the 1st, 2nd, ... restart


def missing_slots(active: Collection[int], wanted: int, draining: Collection[int] = (), groups: int = 0) -> list[int]:
    """The slots to fill so that `wanted` are active: the lowest ones no active replica holds.
    `groups`: the role's cpu_bind entries (slot s binds entry s % groups). Slots whose entry no
    replica holds, active or draining, come first: a scale-up right after a scale-down would
    otherwise take the draining replica's slot and share its cores for the drain's length, where
    cores nobody uses exist."""
    missing: list[int] = []
    if groups:
        busy = {slot % groups for slot in (*active, *draining)}
        free = [group for group in range(groups) if group not in busy]  # slot g binds entry g
        missing = free[: max(0, wanted - len(active))]
    slot = 0
    while len(active) + len(missing) < wanted:
        if slot not in active and slot not in missing:
            missing.append(slot)
        slot += 1
    return sorted(missing)


@dataclass
class Health:
    """Consecutive failed health checks of one replica."""

    failures: int = 0

    def checked(self, ok: bool) -> bool:
        """Record one check; True once the replica is to be declared dead."""
        self.failures = 0 if ok else self.failures + 1
        return self.failures >= HEALTH_FAILURES


@dataclass
class RestartBudget:
    """Starts per slot (role, slot), and whether a slot may start again now."""

    window_s: float = RESTART_WINDOW_S
    limit: int = MAX_RESTARTS
    backoff_s: tuple[float, ...] = RESTART_BACKOFF_S
    _starts: dict[Hashable, list[float]] = field(default_factory=dict)

    def started(self, slot: Hashable, now: float) -> None:
        self._starts.setdefault(slot, []).append(now)

    def refusal(self, slot: Hashable, now: float) -> str | None:
        """None when `slot` may start now; else why not (as a log line would say it)."""
        starts = self._starts.get(slot)
        if not starts:
            return None  # its first start
        recent = [t for t in starts[1:] if now - t < self.window_s]  # restarts in the window
        if len(recent) >= self.limit:
            return f"{len(recent)} restarts in the last {self.window_s:.0f} s"
        pause = self.backoff_s[min(len(starts) - 1, len(self.backoff_s) - 1)]
        if now - starts[-1] < pause:
            return f"waiting {pause:.0f} s between restarts"
        return None

    def forget(self, slot: Hashable) -> None:
        """A slot scaled away: its history no longer matters."""
        self._starts.pop(slot, None)
