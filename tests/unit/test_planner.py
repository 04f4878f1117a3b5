"""The SLO planner's decisions on synthetic snapshots (orchestrator/planner.py): every rule,
hysteresis, cooldown, the budget (a move), min/max, a role no node can place, and advise-only."""

from __future__ import annotations

from dataclasses import replace

from pdcluster.orchestrator.planner import Limits, Planner, RoleView, Snapshot

LIMITS = Limits(
    ttft_p90_s=0.5,
    itl_p90_s=0.05,
    min_replicas={"prefill": 1, "decode": 1},
    max_replicas={"prefill": 3, "decode": 3},
    budget=4,
    cooldown_s=30,
    hysteresis=2,
)


def snap(now=0.0, ttft=0.2, itl=0.02, phase=0.05, prefill=None, decode=None) -> Snapshot:
    return Snapshot(
        now=now,
        ttft_p90_s=ttft,
        itl_p90_s=itl,
        prefill_phase_p90_s=phase,
        roles={"prefill": prefill or RoleView(ready=1), "decode": decode or RoleView(ready=1)},
    )


def run(planner: Planner, *snaps: Snapshot):
    return [planner.decide(s) for s in snaps]


def test_ttft_missed_with_prompts_queued_on_prefill_adds_prefill_after_the_hysteresis():
    planner = Planner(LIMITS)
    queued = RoleView(ready=1, waiting=6)
    first, second = run(planner, snap(0, ttft=1.2, prefill=queued), snap(5, ttft=1.3, prefill=queued))
    assert first.rule == "hold" and "1/2 intervals" in first.reason and not first.actions
    assert second.rule == "add_prefill" and second.actions == (("prefill", "add"),)
    assert "TTFT p90 1300 ms > 500 ms" in second.reason and second.desired == {"prefill": 2, "decode": 1}


def test_ttft_missed_without_queueing_on_prefill_is_not_prefills_to_fix():
    planner = Planner(LIMITS)
    decisions = run(planner, *(snap(t, ttft=1.2, phase=0.05) for t in (0, 5, 10)))
    assert all(d.rule == "hold" for d in decisions)
    slow_phase = run(Planner(LIMITS), *(snap(t, ttft=1.2, phase=0.3) for t in (0, 5)))
    assert slow_phase[-1].actions == (("prefill", "add"),)  # the prefill phase alone takes >= half


def test_itl_missed_or_decode_kv_full_adds_decode():
    assert run(Planner(LIMITS), snap(0, itl=0.09), snap(5, itl=0.08))[-1].actions == (("decode", "add"),)
    full = RoleView(ready=1, kv_usage=0.95)
    decision = run(Planner(LIMITS), snap(0, decode=full), snap(5, decode=full))[-1]
    assert decision.actions == (("decode", "add"),) and "KV usage 95%" in decision.reason


def test_a_streak_broken_starts_over():
    planner = Planner(LIMITS)
    decisions = run(planner, snap(0, itl=0.09), snap(5, itl=0.04), snap(10, itl=0.09))
    assert [d.rule for d in decisions] == ["hold", "hold", "hold"]


def test_both_targets_met_with_margin_remove_from_the_role_with_more_slack_down_to_min():
    two_each = {"prefill": RoleView(ready=2), "decode": RoleView(ready=2)}
    planner = Planner(LIMITS)
    calm = [snap(t, ttft=0.3, itl=0.01, **two_each) for t in (0, 5)]
    decision = run(planner, *calm)[-1]
    assert decision.actions == (("decode", "remove"),)  # ITL at 20 % of target, TTFT at 60 %: decode
    at_min = Planner(LIMITS)
    lone = run(at_min, *(snap(t, ttft=0.01, itl=0.01) for t in (0, 5)))[-1]
    assert lone.rule == "hold" and not lone.actions
    # TTFT (or ITL) at 80 % of its target: met, but not with the 30 % margin: nothing is removed
    assert run(Planner(LIMITS), *(snap(t, ttft=0.4, itl=0.01, **two_each) for t in (0, 5)))[-1].rule == "hold"
    assert run(Planner(LIMITS), *(snap(t, ttft=0.1, itl=0.04, **two_each) for t in (0, 5)))[-1].rule == "hold"


def test_no_traffic_counts_as_met():
    planner = Planner(LIMITS)
    idle = {"prefill": RoleView(ready=2), "decode": RoleView(ready=1)}
    decision = run(planner, *(snap(t, ttft=None, itl=None, phase=None, **idle) for t in (0, 5)))[-1]
    assert decision.actions == (("prefill", "remove"),)


def test_no_samples_while_requests_are_in_flight_is_not_slack():
    """An overloaded prefill whose queued prompts wait past the window yields no TTFT sample: that
    is not an idle cluster, and nothing is removed (prefill queued, or decode still streaming)."""
    for busy in ({"prefill": RoleView(ready=2, waiting=6)}, {"decode": RoleView(ready=2, running=3)}):
        planner = Planner(LIMITS)
        roles = {"prefill": RoleView(ready=2), "decode": RoleView(ready=1), **busy}
        decisions = run(planner, *(snap(t, ttft=None, itl=None, phase=None, **roles) for t in (0, 5, 10)))
        assert all(d.actions == () for d in decisions), decisions


def test_cooldown_and_changes_in_flight_hold_the_next_action():
    planner = Planner(LIMITS)
    queued = RoleView(ready=1, waiting=4)
    assert run(planner, snap(0, ttft=2, prefill=queued), snap(5, ttft=2, prefill=queued))[-1].actions
    starting = RoleView(ready=1, starting=1, waiting=4)
    later = run(planner, snap(10, ttft=2, prefill=starting), snap(15, ttft=2, prefill=starting))[-1]
    assert later.rule == "hold" and "waiting for the last change to land" in later.reason
    landed = RoleView(ready=2, waiting=4)
    cooling = run(planner, snap(20, ttft=2, prefill=landed), snap(25, ttft=2, prefill=landed))[-1]
    assert cooling.rule == "hold" and "cooling down" in cooling.reason
    assert not run(planner, snap(40, ttft=2, prefill=landed))[-1].actions  # 25 s since it landed
    assert run(planner, snap(45, ttft=2, prefill=landed))[-1].actions == (("prefill", "add"),)


def test_max_and_budget_bound_growth_and_a_role_with_slack_gives_one_up():
    at_max = Planner(replace(LIMITS, max_replicas={"prefill": 1, "decode": 3}))
    queued = RoleView(ready=1, waiting=4)
    held = run(at_max, snap(0, ttft=2, prefill=queued), snap(5, ttft=2, prefill=queued))[-1]
    assert held.rule == "hold" and "at its max (1)" in held.reason
    full = {"prefill": RoleView(ready=1, waiting=4), "decode": RoleView(ready=3)}
    planner = Planner(LIMITS)
    move = run(planner, *(snap(t, ttft=2, itl=0.01, **full) for t in (0, 5)))[-1]
    assert move.rule == "move_to_prefill"
    assert move.actions == (("decode", "remove"), ("prefill", "add"))  # drain there, then start here
    assert move.desired == {"prefill": 2, "decode": 2}
    busy = Planner(LIMITS)  # decode misses its own target: nothing to take from it
    stuck = run(busy, *(snap(t, ttft=2, itl=0.045, **full) for t in (0, 5)))[-1]
    assert stuck.rule == "hold" and "budget of 4 is reached" in stuck.reason


def test_a_role_no_node_can_place_is_reported_once():
    planner = Planner(LIMITS)
    nowhere = RoleView(ready=1, waiting=4, unplaceable="no free core in roles.prefill.cpu_bind")
    decisions = run(planner, *(snap(t, ttft=2, prefill=nowhere) for t in range(0, 30, 5)))
    assert [d.rule for d in decisions].count("unplaceable") == 1
    assert "but no free core in roles.prefill.cpu_bind" in decisions[1].reason
    assert not any(d.actions for d in decisions)
    placeable = replace(nowhere, unplaceable="")
    assert run(planner, snap(40, ttft=2, prefill=placeable))[-1].actions == (("prefill", "add"),)


def test_a_role_at_its_max_lets_the_next_rule_act():
    """Prefill at its max misses TTFT while decode misses ITL: decode is still added (the hold on
    prefill's bound ended the decision before)."""
    planner = Planner(replace(LIMITS, max_replicas={"prefill": 1, "decode": 3}))
    queued = RoleView(ready=1, waiting=4)
    decision = run(planner, *(snap(t, ttft=2, itl=0.09, prefill=queued) for t in (0, 5)))[-1]
    assert decision.rule == "add_decode" and decision.actions == (("decode", "add"),)


def test_the_cooldown_counts_from_when_the_last_change_landed():
    """A replica that takes longer to start than the cooldown: once it is ready the planner waits a
    cooldown more (the window then shows the new size), not acting on samples of the old one."""
    planner = Planner(LIMITS)
    queued = RoleView(ready=1, waiting=4)
    assert run(planner, snap(0, ttft=2, prefill=queued), snap(5, ttft=2, prefill=queued))[-1].actions
    starting = RoleView(ready=1, starting=1, waiting=4)
    run(planner, *(snap(t, ttft=2, prefill=starting) for t in range(10, 200, 10)))
    landed = RoleView(ready=2, waiting=4)
    assert run(planner, snap(210, ttft=2, prefill=landed))[-1].rule == "hold"
    assert "cooling down" in run(planner, snap(215, ttft=2, prefill=landed))[-1].reason
    assert run(planner, snap(195 + LIMITS.cooldown_s, ttft=2, prefill=landed))[-1].actions == (("prefill", "add"),)


def test_with_prefill_scaled_to_zero_a_ttft_miss_adds_prefill_again():
    """At 0 prefill replicas (min 0) decode computes every prompt: no prefill queue or phase to
    show, and a TTFT miss still brings a prefill replica back (it never did)."""
    planner = Planner(replace(LIMITS, min_replicas={"prefill": 0, "decode": 1}))
    none = RoleView(ready=0)
    decision = run(planner, *(snap(t, ttft=2, phase=None, prefill=none) for t in (0, 5)))[-1]
    assert decision.rule == "add_prefill" and decision.desired == {"prefill": 1, "decode": 1}


def test_a_cooldown_shorter_than_the_window_waits_for_the_window():
    """window_seconds 120, cooldown_seconds 60: at 60 s after a change landed the p90 still held
    60 s of the old size's latencies, and the planner acted on them again (toward max, then back).
    The cooldown counts as the window's length where it is shorter."""
    from pdcluster.config import validate_config
    from pdcluster.orchestrator.autoscale import limits

    section = validate_config(
        {"model": {"path": "m"}, "autoscale": {"window_seconds": 120, "cooldown_seconds": 60}}, "test"
    ).autoscale
    assert limits(section).cooldown_s == 120
    assert limits(section.model_copy(update={"cooldown_seconds": 300})).cooldown_s == 300
