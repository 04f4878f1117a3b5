"""The controller's readiness wait and scaling, on the controller object itself (no Ray: these
calls touch only its replica table, with a stand-in router where one is called): `up` returns
once nothing is starting, `scale --wait` asks again only after the table changed, instead of
asking back to back while a replica drains (nothing starting: the plain wait returns at once);
`scale` refuses what the YAML refuses and drains only replicas still alive after its awaits;
status, scale, the monitor and the planner's loop go on when the router, or one interval, fails."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from pdcluster.config import validate_config
from pdcluster.errors import ConfigError
from pdcluster.orchestrator.controller import Controller

CONFIG = validate_config({"model": {"path": "models/pdcluster-tiny-code"}}, "test")


def test_a_wait_for_a_change_returns_only_once_the_replica_table_changed():
    async def scenario() -> tuple[bool, bool, bool]:
        controller = Controller(CONFIG.model_dump_json(), "secret")
        at_once = await asyncio.wait_for(controller.wait_ready(30), timeout=5)  # nothing starting
        waiting = asyncio.create_task(controller.wait_ready(30, change=True))
        for _ in range(20):
            await asyncio.sleep(0)  # the waiter runs up to its wait
        early = waiting.done()
        await controller._publish()  # what a state change does (no router yet: only the waiters)
        return at_once, early, await asyncio.wait_for(waiting, timeout=5)

    at_once, early, after_change = asyncio.run(scenario())
    assert at_once is True
    assert early is False  # nothing changed yet
    assert after_change is True


def test_a_wait_for_a_change_gives_up_at_its_timeout():
    async def scenario() -> bool:
        controller = Controller(CONFIG.model_dump_json(), "secret")
        return await controller.wait_ready(0.2, change=True)

    assert asyncio.run(scenario()) is False


def test_a_watch_wakes_at_each_publish_while_a_replica_starts_and_gives_up_at_its_timeout():
    """`status --watch` waited with the readiness wait (for a change), which goes on waiting while
    a replica starts: a watch showed nothing of a start until it ended. It waits for the next
    publish, whatever is starting (and not for one that came before it asked)."""
    from pdcluster.orchestrator.replicas import ReplicaState

    async def scenario() -> tuple[bool, bool, bool]:
        controller = serving_decodes(1)
        controller.pools["decode"][0].state = ReplicaState.STARTING
        await controller._publish()  # before the watch asks: not its wake-up
        waiting = asyncio.create_task(controller.next_publish(30))
        for _ in range(20):
            await asyncio.sleep(0)  # the waiter runs up to its wait
        early = waiting.done()
        await controller._publish()  # the monitor's next pass, the replica still starting
        woken = await asyncio.wait_for(waiting, timeout=5)
        return early, woken, await controller.next_publish(0.2)

    early, woken, timed_out = asyncio.run(scenario())
    assert (early, woken, timed_out) == (False, True, False)


def test_scale_refuses_what_the_cluster_yaml_refuses():
    """`scale` checks the new size as the YAML's own rules do: no decode replica in disaggregated
    mode, more than 64, sizes outside the planner's bounds; the config is left as it was."""
    planned = validate_config(
        {
            "model": {"path": "models/pdcluster-tiny-code"},
            "autoscale": {"enabled": True, "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 3}},
        },
        "test",
    )
    for config, role, replicas, says in [
        (CONFIG, "decode", 0, "roles.decode.replicas: disaggregated mode needs ≥ 1 decode replica"),
        (CONFIG, "prefill", 65, "roles.prefill.replicas: must be ≤ 64"),
        (planned, "decode", 4, "roles.decode.replicas: must be within autoscale.decode min..max (1..3)"),
    ]:
        controller = Controller(config.model_dump_json(), "secret")
        with pytest.raises(ConfigError, match=re.escape(f"scale {role} {replicas}: {says}")):
            asyncio.run(controller.scale(role, replicas))
        assert controller.config.role(role).replicas == config.role(role).replicas


def serving_decodes(count: int, config=CONFIG) -> Controller:
    """A controller whose table holds `count` ready decode replicas (no actors: nothing here
    calls one)."""
    from pdcluster.orchestrator.engines import engine_spec
    from pdcluster.orchestrator.replicas import Replica, ReplicaState

    controller = Controller(config.model_dump_json(), "secret")
    for i in range(count):
        index = controller.next_index["decode"]  # as the controller numbers its replicas
        controller.next_index["decode"] += 1
        replica = Replica(f"decode-{index}", "decode", index, i, engine_spec(config, "decode", i, f"decode-{index}"))
        replica.url, replica.state = f"http://127.0.0.1:{9000 + i}", ReplicaState.READY
        controller.pools["decode"].append(replica)
    controller.config.roles.decode.replicas = count
    return controller


class _Remote:
    """A Ray actor method as the controller calls it (`.remote(...)`, awaited)."""

    def __init__(self, call):
        self.remote = call


def test_a_replica_that_dies_while_a_scale_down_asks_the_router_is_not_drained_again():
    """Scale decode 3 -> 1 while one replica dies during the scale's call to the router (the
    monitor retires it, as _replace does): the replicas drained are chosen among the live ones
    after that call, so the dead one is not drained a second time (its stop raised, since it
    had left the pool) and one replica is left serving."""
    from pdcluster.orchestrator.replicas import ReplicaState

    async def scenario():
        controller = serving_decodes(3)
        pool = controller.pools["decode"]

        async def inflight():
            dead = pool[0]  # dies meanwhile: retired by the monitor
            dead.set_state(ReplicaState.DEAD)
            pool.remove(dead)
            controller._retired.append(dead)
            return {}

        async def update_replicas(rows):
            return None

        controller.routers.actor = type("Router", (), {})()
        controller.router.inflight, controller.router.update_replicas = _Remote(inflight), _Remote(update_replicas)
        result = await controller.scale("decode", 1)
        stops = [r.task for r in controller._retired + pool if r.task is not None]
        outcomes = await asyncio.gather(*stops, return_exceptions=True)
        return result, outcomes, [r.replica_id for r in pool if r.state == ReplicaState.READY]

    result, outcomes, serving = asyncio.run(scenario())
    assert "decode-0" not in result["draining"] and len(result["draining"]) == 1
    assert not [o for o in outcomes if isinstance(o, BaseException)]
    assert len(serving) == 1


def test_the_monitor_goes_on_when_the_router_cannot_be_told():
    """The router cannot be told (Ray's connection to its node broke: ActorUnavailableError on
    every call): the monitor logs it and keeps checking the replicas each second; its task once
    ended there, and with it every health check and restart."""
    import ray

    calls = []

    async def update_replicas(rows):
        calls.append(rows)
        raise ray.exceptions.ActorUnavailableError("the node's connection broke", None)

    async def scenario():
        controller = Controller(CONFIG.model_dump_json(), "secret")
        for role in ("prefill", "decode"):
            controller.config.role(role).replicas = 0  # nothing to start: no actors here
        controller.routers.actor = type("Router", (), {"update_replicas": _Remote(update_replicas)})()
        monitor = asyncio.create_task(controller._monitor_loop())
        while len(calls) < 2 and not monitor.done():
            await asyncio.sleep(0.05)  # the loop's own pace (MONITOR_INTERVAL_S)
        alive = not monitor.done()
        controller._stopping = True
        monitor.cancel()
        return alive

    assert asyncio.run(scenario()) is True
    assert len(calls) >= 2


def test_status_and_scale_go_on_when_the_router_is_gone(killed, new_routers):
    """The router actor died: `status` failed as a whole with Ray's error, losing the replica
    table when it is needed most, and `scale` failed too. status shows the table and says the
    router is gone; a scale-down drains by state alone (its publish finds the router dead: a new
    one is started, router_keeper.py)."""
    import ray

    from pdcluster.orchestrator.status import format_status

    async def gone(*args):
        raise ray.exceptions.RayActorError()

    async def scenario():
        controller = serving_decodes(2)
        pool = controller.pools["decode"]
        methods = ("latency", "inflight", "rss_bytes", "route_decisions", "cache_index", "update_replicas")
        controller.routers.actor = type("Router", (), {name: _Remote(gone) for name in methods})()
        status = await controller.status()
        result = await controller.scale("decode", 1)
        await asyncio.gather(*(r.task for r in controller._retired + pool if r.task is not None))
        return status, result

    status, result = asyncio.run(scenario())
    assert [r["replica"] for r in status["replicas"]] == ["decode-0", "decode-1"]
    assert status["router_error"].startswith("the router is gone")
    assert "router: the router is gone, the endpoint serves nothing" in format_status(status)
    assert len(result["draining"]) == 1


class _RouterActors:
    """Ray's actor class of the router as the keeper makes its actors (`ray.remote(RouterActor)
    .options(...).remote(settings)`): each new actor's `start` raises or serves, from `outcomes`
    in turn, and records what it was asked and what the keeper said meanwhile."""

    def __init__(self) -> None:
        self.outcomes: list = []
        self.started: list[tuple] = []
        self.actors: list = []
        self.keeper = None

    def options(self, **options):
        return self

    def remote(self, settings):
        outcome = self.outcomes.pop(0) if self.outcomes else "serves"

        async def start(host, port, rows):
            self.started.append((host, port, [row["replica_id"] for row in rows], self.keeper.down))
            if isinstance(outcome, BaseException):
                raise outcome
            return f"http://{host}:{port}"

        async def nothing(*args):
            return {}

        methods = ("update_replicas", "latency", "inflight", "rss_bytes", "route_decisions", "cache_index")
        actor = type("Router", (), {"start": _Remote(start), **{name: _Remote(nothing) for name in methods}})()
        self.actors.append(actor)
        return actor


@pytest.fixture
def new_routers(monkeypatch) -> _RouterActors:
    import ray

    routers = _RouterActors()
    monkeypatch.setattr(ray, "remote", lambda cls: routers)
    return routers


def test_a_router_found_dead_is_started_again_on_its_port_with_the_replica_table(killed, new_routers):
    """The router actor died (the OOM killer, a crash) and nothing started another: the endpoint
    served nothing until `down` and `up`, every replica behind it still running. The monitor's
    publish finds it dead; a new router starts on the same address and port with the replica
    table; one that fails to start is killed and tried again on a later pass; `status` says why no
    router serves meanwhile, then how often it was restarted."""
    import ray

    from pdcluster.orchestrator.status import format_status

    async def dead(rows):
        raise ray.exceptions.ActorDiedError()

    controller = serving_decodes(1)
    controller.config.role("prefill").replicas = 0
    controller.routers.endpoint = "http://127.0.0.1:8123"
    controller.routers.actor = dead_router = type("Router", (), {"update_replicas": _Remote(dead)})()
    new_routers.keeper = controller.routers
    new_routers.outcomes = [RuntimeError("no node can place it")]
    assert run_monitor(controller, lambda: controller.routers.restarts == 1) is True
    failed, served = new_routers.started
    assert failed[:3] == served[:3] == (controller.config.router.host, 8123, ["decode-0"])
    assert failed[3].startswith("the router is gone (")  # (Ray's words for the death)
    assert served[3].startswith("the router is gone; a new one failed to start (RuntimeError: no node can place it)")
    assert killed == [dead_router, new_routers.actors[0]]  # the dead one, the one that failed to start
    assert controller.router is new_routers.actors[1] and controller.endpoint == "http://127.0.0.1:8123"
    status = asyncio.run(controller.status())
    assert status["router_error"] is None and status["router_restarts"] == 1
    assert "router: restarted 1 time(s) (it died or hung)" in format_status(status)


def test_a_router_that_leaves_the_replica_table_unanswered_is_killed_and_replaced(killed, new_routers, monkeypatch):
    """A router hung (its event loop stuck, its process stopped) is not dead to Ray: the publish
    waited on it for good, and with it the controller's monitor (every replica's health check
    and restart). An update unanswered in time counts as a failed health check; HEALTH_FAILURES
    in a row and the router is killed and another started."""
    from pdcluster.orchestrator import router_keeper
    from pdcluster.orchestrator.reconcile import HEALTH_FAILURES

    monkeypatch.setattr(router_keeper, "UPDATE_TIMEOUT_S", 0.05)
    updates = []

    async def hung(rows):
        updates.append(rows)
        await asyncio.Event().wait()

    controller = serving_decodes(1)
    controller.config.role("prefill").replicas = 0
    controller.routers.endpoint = "http://127.0.0.1:8124"
    controller.routers.actor = hung_router = type("Router", (), {"update_replicas": _Remote(hung)})()
    new_routers.keeper = controller.routers
    assert run_monitor(controller, lambda: controller.routers.restarts == 1) is True
    assert len(updates) == HEALTH_FAILURES and killed == [hung_router]
    ((_, port, rows, down_then),) = new_routers.started
    assert (port, rows) == (8124, ["decode-0"])
    assert down_then.startswith(f"the router is gone (TimeoutError: {HEALTH_FAILURES} replica-table updates in a row")


def test_the_planner_goes_on_after_an_interval_that_failed():
    """The planner's loop caught only Ray's errors and timeouts: anything else (a GCS hiccup
    raising ConnectionError from ray.nodes(), an unexpected stats shape) ended its task, nobody
    awaiting it, and autoscaling stopped for good while `status` showed its last decision."""
    from pdcluster.orchestrator.autoscale import PlannerLoop

    planned = validate_config(
        {"model": {"path": "models/pdcluster-tiny-code"}, "autoscale": {"enabled": True, "interval_seconds": 0.01}},
        "test",
    )
    decided = []

    async def scenario() -> bool:
        loop = PlannerLoop(Controller(planned.model_dump_json(), "secret"))

        async def snapshot():
            decided.append(len(decided))
            raise ConnectionError("GCS unavailable") if len(decided) == 1 else KeyError("waiting")

        loop.snapshot = snapshot
        loop.start()
        while len(decided) < 3 and not loop._task.done():
            await asyncio.sleep(0.01)  # the planner's own interval
        alive = not loop._task.done()
        loop.stop()
        return alive

    assert asyncio.run(scenario()) is True
    assert len(decided) >= 3


async def held_by_ray(replica):
    """A replica's start as Ray's scheduling makes it when no node has room: it never ends."""
    await asyncio.Event().wait()


async def planner_adding_one_that_never_starts():
    """(controller, its planner loop, the replica the planner added, when it asked): decode serves
    one replica; the planner adds one whose start never ends (Ray's scheduling stood in for: Ray
    keeps an actor whose resources exist but are taken pending for as long as they are)."""
    from pdcluster.orchestrator.autoscale import PlannerLoop
    from pdcluster.orchestrator.planner import Decision
    from pdcluster.orchestrator.replicas import ReplicaState

    planned = validate_config(
        {
            "model": {"path": "models/pdcluster-tiny-code"},
            "autoscale": {"enabled": True, "decode": {"min": 1, "max": 3}, "start_timeout_seconds": 600},
        },
        "test",
    )

    async def nothing(*args):
        return {}

    controller = serving_decodes(1, planned)
    controller._start_replica = held_by_ray
    controller._placement_problem = lambda role: None
    methods = ("planner", "inflight", "update_replicas")
    controller.routers.actor = type("Router", (), {name: _Remote(nothing) for name in methods})()
    loop = PlannerLoop(controller)
    await loop.apply(Decision("add_decode", "ITL p90 300 ms > 100 ms", (("decode", "add"),), {}, "decode"))
    (added,) = [r for r in controller.pools["decode"] if r.state == ReplicaState.STARTING]
    return controller, loop, added, time.monotonic()


def test_a_replica_the_planner_added_that_never_starts_is_scaled_away_and_its_role_held():
    """Ray keeps an actor whose resources exist but are taken pending for as long as they are,
    and the planner held every later action "waiting for the last change to land", for good.
    start_timeout_seconds after it added the replica, the replica is scaled away and decode counts
    as unplaceable (the planner reports it, once) for a cooldown; after that it may grow again."""
    from pdcluster.orchestrator.replicas import ReplicaState

    async def scenario():
        controller, loop, added, asked = await planner_adding_one_that_never_starts()
        await loop.give_up_unstarted(asked + 590)
        early = (added.state, loop.unplaceable("decode", 2, asked + 590))
        await loop.give_up_unstarted(asked + 610)
        await added.task  # its drain
        held = loop.unplaceable("decode", 1, asked + 620)
        cooldown = loop.planner.limits.cooldown_s
        return early, added, controller, held, loop.unplaceable("decode", 1, asked + 611 + cooldown)

    early, added, controller, held, later = asyncio.run(scenario())
    assert early == (ReplicaState.STARTING, "")  # before its deadline: nothing happens
    assert added.state == ReplicaState.DEAD and added not in controller.pools["decode"]
    assert controller.config.roles.decode.replicas == 1
    assert held.startswith(f"{added.replica_id} (") and held.endswith(") not ready 600 s after the planner added it"), (
        held
    )
    assert later == ""  # a cooldown later decode may grow again


def test_the_planner_scales_away_its_own_unstarted_replica_not_a_newer_replacement():
    """The planner's replica never starts; meanwhile a serving replica dies and its replacement
    is still starting when the start timeout passes. The planner asked to drain "one fewer", and
    resize chose the newest starting replica: the replacement went, the planner's stayed pending
    and was never given up again (its record gone), and the planner waited on it for good."""
    from pdcluster.orchestrator.replicas import ReplicaState

    async def scenario():
        controller, loop, planners, asked = await planner_adding_one_that_never_starts()
        pool = controller.pools["decode"]
        serving = next(r for r in pool if r.state == ReplicaState.READY)
        serving.set_state(ReplicaState.DEAD)  # what the monitor does before it replaces it
        controller._replace(serving)
        (replacement,) = [r for r in pool if r.state == ReplicaState.STARTING and r is not planners]
        await loop.give_up_unstarted(asked + 610)
        return planners, replacement

    planners, replacement = asyncio.run(scenario())
    assert planners.state in (ReplicaState.DRAINING, ReplicaState.DEAD)
    assert replacement.state == ReplicaState.STARTING


class _Actor:
    """A replica's actor as the controller calls it: `info` answers from `answers` in turn (an
    exception is raised); `shutdown` waits for `stopped`."""

    def __init__(self, answers=(), stopped: asyncio.Event | None = None):
        self.answers, self.calls, self.stopped = list(answers), 0, stopped

        async def info():
            self.calls += 1
            answer = self.answers.pop(0) if self.answers else {"healthy": True}
            if isinstance(answer, BaseException):
                raise answer
            return answer

        async def shutdown():
            await self.stopped.wait()

        self.info, self.shutdown = _Remote(info), _Remote(shutdown)


@pytest.fixture
def killed(monkeypatch) -> list:
    """The actors the controller kills (ray.kill stood in for: these actors are stand-ins). Like
    Ray's, it refuses what is not an actor (None here)."""
    import ray

    calls = []

    def kill(actor, no_restart=True):
        calls.append(actor)
        if actor is None:
            raise ValueError("ray.kill() only supported for actors. Got: <class 'NoneType'>.")

    monkeypatch.setattr(ray, "kill", kill)
    return calls


def run_monitor(controller: Controller, until, limit_s: float = 10.0) -> bool:
    """Run the controller's monitor until `until()` or `limit_s`; whether its task was still alive."""

    async def scenario() -> bool:
        monitor = asyncio.create_task(controller._monitor_loop())
        deadline = time.monotonic() + limit_s
        while not until() and not monitor.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the loop's own pace (MONITOR_INTERVAL_S)
        alive = not monitor.done()
        controller._stopping = True
        monitor.cancel()
        return alive

    return asyncio.run(scenario())


def test_the_monitor_goes_on_after_a_pass_that_failed():
    """A pass of the monitor raised what it did not expect (here ray.nodes() in a GCS hiccup, as
    it refilled an empty decode slot): its task ended, nobody awaiting it, and with it every
    health check, replacement and router update, silently. The pass is logged; the next one
    refills the slot."""
    controller = Controller(CONFIG.model_dump_json(), "secret")
    controller.config.role("prefill").replicas = 0
    asked = []

    def placement_problem(role):
        asked.append(role)
        if len(asked) == 1:
            raise ConnectionError("GCS unavailable")
        return None

    controller._placement_problem, controller._start_replica = placement_problem, held_by_ray
    pool = controller.pools["decode"]
    assert run_monitor(controller, lambda: pool) is True
    assert [r.replica_id for r in pool] == ["decode-0"]


def test_an_actor_unavailable_for_a_moment_is_an_unanswered_check_not_a_death(killed):
    """Ray raises ActorUnavailableError (a RayActorError) when the connection to an actor's node
    broke for a moment; the replica was declared dead on the first one, its actor killed and its
    streams cut. It now counts as one unanswered check of HEALTH_FAILURES."""
    import ray

    controller = serving_decodes(1)
    controller.config.role("prefill").replicas = 0
    (replica,) = controller.pools["decode"]
    replica.actor = _Actor([ray.exceptions.ActorUnavailableError("the node's connection broke", None)])
    assert run_monitor(controller, lambda: replica.actor.calls >= 3) is True
    assert replica.state.name == "READY" and replica.actor.calls >= 3
    assert killed == []


def test_a_drained_replica_found_dead_while_it_shuts_down_is_still_retired(killed):
    """A replica's drain waits for its actor's shutdown; meanwhile the monitor finds it dead and
    kills its actor (its actor is then None). The drain then killed None (a ValueError), its task
    ended there and the replica stayed DRAINING in the pool for good (the planner waiting on it)."""
    from pdcluster.orchestrator.replicas import ReplicaState

    async def scenario():
        controller = serving_decodes(2)
        replica = controller.pools["decode"][0]
        stopped = asyncio.Event()
        replica.actor = _Actor(stopped=stopped)
        replica.set_state(ReplicaState.DRAINING)
        stop = asyncio.create_task(controller._stop_replica(replica))
        await asyncio.sleep(0)  # the stop awaits the actor's shutdown
        replica.actor = None  # what the monitor does to a draining replica it found dead
        stopped.set()
        await asyncio.wait_for(stop, 5)
        return controller, replica

    controller, replica = asyncio.run(scenario())
    assert replica.state == ReplicaState.DEAD and replica in controller._retired
    assert replica not in controller.pools["decode"]
    assert killed == []  # the monitor killed it already
