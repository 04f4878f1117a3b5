"""The controller's rules for holding each role at its size (orchestrator/reconcile.py)."""

from __future__ import annotations

from pdcluster.orchestrator.reconcile import (
    HEALTH_FAILURES,
    MAX_RESTARTS,
    RESTART_BACKOFF_S,
    RESTART_WINDOW_S,
    Health,
    RestartBudget,
    missing_slots,
)


def test_missing_slots_are_the_lowest_free_ones():
    assert missing_slots(set(), 2) == [0, 1]
    assert missing_slots({1}, 2) == [0]
    assert missing_slots({0, 3}, 4) == [1, 2]
    assert missing_slots({0, 1, 2}, 2) == []  # draining ones are not active; more active: none


def test_a_scale_up_during_a_drain_takes_cores_nobody_holds():
    """cpu_bind ['0', '1', '2', '3'], decode 2 -> 1 -> 2 while slot 1 drains: the new replica took
    slot 1 and shared core 1 with the draining one until its drain ended. It takes slot 2 (core 2)
    now; where every core is held it shares with the draining replica, not with an active one."""
    assert missing_slots({0}, 2, draining={1}, groups=4) == [2]
    assert missing_slots({0}, 3, draining={1}, groups=4) == [2, 3]
    assert missing_slots({0}, 2, draining={1}, groups=2) == [1]  # no free core: the draining one's
    assert missing_slots({0}, 4, draining={1}, groups=2) == [1, 2, 3]
    assert missing_slots({0}, 2, draining={1}) == [1]  # no cpu_bind: the slot binds nothing
    assert missing_slots({1}, 2, groups=4) == [0]


def test_one_slow_health_check_is_not_a_death():
    health = Health()
    assert not any(health.checked(False) for _ in range(HEALTH_FAILURES - 1))
    assert not health.checked(True)  # an answer resets the count
    assert not any(health.checked(False) for _ in range(HEALTH_FAILURES - 1))
    assert health.checked(False)


def test_a_slot_restarts_at_once_then_with_growing_pauses_then_not_within_the_window():
    budget, slot, now = RestartBudget(), ("decode", 0), 1000.0
    assert budget.refusal(slot, now) is None  # its first start
    budget.started(slot, now)
    for restart in range(MAX_RESTARTS):
        pause = RESTART_BACKOFF_S[min(restart, len(RESTART_BACKOFF_S) - 1)]
        if pause:
            assert "waiting" in budget.refusal(slot, now + pause - 0.5)
        now += pause
        assert budget.refusal(slot, now) is None, restart
        budget.started(slot, now)
    later = now + RESTART_BACKOFF_S[-1]
    assert budget.refusal(slot, later) == f"{MAX_RESTARTS} restarts in the last {RESTART_WINDOW_S:.0f} s"
    assert budget.refusal(("decode", 1), later) is None  # budgets are per slot, not per role
    assert budget.refusal(slot, now + RESTART_WINDOW_S + 1) is None  # the window moved on
