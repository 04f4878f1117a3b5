"""The controller: a detached, named Ray actor that owns the cluster's replica pools.

It creates the router actor (router_keeper.py: started again where it died) and one worker actor
per replica (prefill/decode/aggregated), starts their engines concurrently and publishes each
replica to the router only once it is READY. A
monitor loop refreshes engine stats (pushed to the router for /metrics and routing), marks
replicas DEAD (their actor gone, their engine dead, or HEALTH_FAILURES health checks in a row
unanswered) and refills the empty replica slots of each role (reconcile.py: a slot's restarts
are budgeted and paused, and a replica that failed to start is retried later). `scale(role, n)` adds replicas (traffic once ready) or drains some
(no new requests; stopped once nothing is in flight and, for prefill, no KV lease is held).
Replicas go to the Ray nodes their role's placement allows (placement.py); a role no live
node can host is reported once and waits for one. `status()` is what `pdcluster status` prints
(rows: status.py). The router and worker actors are detached: they serve on while the
controller is down, and a controller Ray restarted takes them back from its record (recovery.py);
`shutdown()` stops engines gracefully before their actors are killed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

from pydantic import ValidationError

from pdcluster.config import ClusterConfig, RoleName
from pdcluster.errors import ConfigError, format_errors, one_line
from pdcluster.logs import WarnOnce, setup_logging
from pdcluster.orchestrator.autoscale import PlannerLoop
from pdcluster.orchestrator.engines import engine_spec, worker_class
from pdcluster.orchestrator.placement import actor_options, demand, unplaceable
from pdcluster.orchestrator.reconcile import HEALTH_FAILURES, RestartBudget, missing_slots
from pdcluster.orchestrator.recovery import Record, end_cluster, recover, replica_name
from pdcluster.orchestrator.replicas import Replica, ReplicaState
from pdcluster.orchestrator.router_keeper import RouterKeeper, router_settings
from pdcluster.orchestrator.status import replica_row, retired_row

logger = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
INFO_TIMEOUT_S = 10.0


# The router's answers `status` shows (RouterActor methods).
ROUTER_VIEW = ("latency", "inflight", "rss_bytes", "route_decisions", "cache_index")


class Controller:
    def __init__(self, config_json: str, secret: str, api_keys: list[str] | None = None):
        """`secret` and `api_keys` are what `up` read from the files the config names, on its
        own machine (the controller may run on another node)."""
        setup_logging()
        self.config = ClusterConfig.model_validate_json(config_json)
        self._secret = secret
        self._given_api_keys = api_keys
        self._retired: list[Replica] = []
        self._budget = RestartBudget()
        self._refused: set[tuple[str, int, str]] = set()  # restart refusals logged (once each)
        self.unplaced: dict[str, str] = {}  # role -> why no live node can host a replica now
        self.pools: dict[str, list[Replica]] = {role: [] for role in ("prefill", "decode", "aggregated")}
        self.next_index = dict.fromkeys(self.pools, 0)  # replica ids are never reused
        self.routers = RouterKeeper(
            self.config, lambda: router_settings(self.config, self._api_keys(), secret), self._rows, self._budget
        )
        self.started_at = time.time()
        self._monitor: asyncio.Task | None = None
        self.planner: PlannerLoop | None = None  # autoscale.enabled: the SLO planner (autoscale.py)
        self._published = asyncio.Condition()  # each publish notifies it (next_publish)
        self._stopping = False
        self._lock = asyncio.Lock()
        self.restarts = 0  # times Ray restarted this controller (its process died)
        self.record = Record(self.config.name, self.config.ray.namespace)
        self._warn_once = WarnOnce(logger)
        self._recovery = asyncio.create_task(self._recover()) if _reconstructed() else None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> str:
        """Start the router and every configured replica; returns the endpoint URL at once."""
        cfg = self.config
        for role in cfg.serving_roles():
            problem = self._placement_problem(role) if cfg.role(role).replicas else None
            if problem:
                raise ConfigError(f"roles.{role}.placement: {problem}")
        await self.routers.start(cfg.router.host, cfg.router.port)
        self._reconcile()
        self._save_record()  # from here on a restarted controller takes the cluster back
        self._run()
        return self.endpoint

    def _run(self) -> None:
        """Start the monitor (and the planner): the controller runs the cluster from here on."""
        self._monitor = asyncio.create_task(self._monitor_loop())
        if self.config.autoscale.enabled:
            self.planner = PlannerLoop(self)
            self.planner.start()

    async def _recover(self) -> None:
        """Ray restarted this controller (its process died): take the cluster back from the
        record (recovery.py). With none, it died in `start` (so `up` fails and stops it): what
        it had started is removed."""
        try:
            record = self.record.load()
            if record is None:
                logger.error("controller restarted before its cluster started: removing what it had started")
                end_cluster(self.config.name, self.config.ray.namespace)
                return
            recover(self, record)
        except Exception:  # noqa: BLE001 - nobody awaits this task: the reason must reach the log
            logger.exception("the restarted controller could not take its cluster back")
            return
        self._reconcile()
        self._run()
        await self._publish()

    @property
    def router(self):
        """The router actor (None while there is none: not started yet, or being replaced)."""
        return self.routers.actor

    @property
    def endpoint(self) -> str | None:
        return self.routers.endpoint

    def _rows(self) -> list[dict[str, Any]]:
        """The replica table the router routes by: every replica with an endpoint."""
        return [r.router_row() for pool in self.pools.values() for r in pool if r.url]

    def _api_keys(self) -> list[str]:
        if self._given_api_keys is not None:
            return list(self._given_api_keys)
        return self.config.router.read_api_keys()

    def _add_replica(self, role: RoleName, slot: int) -> Replica:
        index = self.next_index[role]
        self.next_index[role] += 1
        replica_id = f"{role}-{index}"
        spec = engine_spec(self.config, role, slot, replica_id)  # the slot's cores (cpu_bind)
        replica = Replica(replica_id, role, index, slot, spec)
        self._budget.started((role, slot), time.monotonic())
        self._refused = {key for key in self._refused if key[:2] != (role, slot)}
        replica.set_state(ReplicaState.STARTING)
        self.pools[role].append(replica)
        replica.task = asyncio.create_task(self._start_replica(replica))
        return replica

    async def _start_replica(self, replica: Replica) -> None:
        import ray

        section = self.config.role(replica.role)
        options: dict[str, Any] = {
            "name": replica_name(self.config.name, replica.replica_id),
            "lifetime": "detached",  # it serves on while the controller is down (recovery.py)
            "max_concurrency": 64,
            "runtime_env": {"env_vars": replica.spec.env()},
            **actor_options(section.resources, section.placement),
        }
        try:
            replica.stage = "scheduling actor"
            replica.actor = ray.remote(worker_class(replica.role)).options(**options).remote(replica.spec, self._secret)
            replica.stage = "starting engine"
            info = await replica.actor.start.remote()
        except Exception as exc:  # noqa: BLE001 - any failure to start marks the replica dead
            replica.error = one_line(exc)  # the engine's reason, not Ray's header naming the task
            replica.stage = "failed"
            replica.set_state(ReplicaState.DEAD)
            if replica.actor is not None:  # its process outlives a failed start: held resources
                ray.kill(replica.actor, no_restart=True)
                replica.actor = None
            logger.error("replica %s failed to start: %s", replica.replica_id, replica.error)
            self._reconcile()  # its slot is tried again (now, or after its pause)
            await self._publish()
            return
        if replica.state != ReplicaState.STARTING:  # scaled away while starting
            return
        replica.info = info
        replica.url = info["url"]
        replica.node = info.get("node", "")
        replica.stage = "ready"
        replica.ready_at = time.time()
        replica.set_state(ReplicaState.READY)
        logger.info("replica %s ready at %s", replica.replica_id, replica.url)
        await self._publish()

    async def _publish(self) -> None:
        """Push replica membership and stats to the router (a router found dead or hung is
        replaced: router_keeper.py); wake up waiters."""
        self._save_record()
        await self.routers.publish()
        async with self._published:
            self._published.notify_all()

    def _save_record(self) -> None:
        try:
            self.record.save(self)
        except Exception as exc:  # noqa: BLE001 - a GCS hiccup: the next publish writes it
            self._warn_once("record", "cannot write the controller's record: %s", one_line(exc, 200))

    async def _monitor_loop(self) -> None:
        """Check every replica, refill empty slots and tell the router, each second. Nobody awaits
        this task: a pass that fails (a GCS hiccup raising from ray.nodes(), a replica's odd
        answer) is logged and the next one runs; one that ended the task ended every health
        check and restart for good, silently."""
        while not self._stopping:
            try:
                await self._monitor_once()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one pass
                logger.exception("health monitor pass failed; the next one runs in %.0f s", MONITOR_INTERVAL_S)
            await asyncio.sleep(MONITOR_INTERVAL_S)  # polling interval of the health monitor

    async def _monitor_once(self) -> None:
        import ray

        live = [
            r
            for pool in self.pools.values()
            for r in pool
            # (a draining replica found dead has no actor left: its drain retires it)
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING) and r.actor is not None
        ]
        refs = [r.actor.info.remote() for r in live]
        for replica, ref in zip(live, refs):
            try:
                async with asyncio.timeout(INFO_TIMEOUT_S):
                    replica.info = await ref
                problem = None if replica.info.get("healthy", True) else "engine died"
                replica.health.checked(True)
            except ray.exceptions.ActorUnavailableError as exc:
                # Ray's "temporarily unavailable" (a connection to its node broke), not a death:
                # counted as an unanswered check (a RayActorError subclass, so caught first).
                dead = replica.health.checked(False)
                problem = f"{HEALTH_FAILURES} health checks failed, the last: {one_line(exc, 200)}" if dead else None
            except ray.exceptions.RayActorError as exc:
                problem = f"unreachable: {type(exc).__name__}"  # its actor is gone
            except asyncio.TimeoutError:
                # One slow answer is not a death: only HEALTH_FAILURES in a row.
                dead = replica.health.checked(False)
                problem = f"{HEALTH_FAILURES} health checks unanswered in {INFO_TIMEOUT_S:.0f} s" if dead else None
            if problem and replica.state == ReplicaState.READY:
                replica.error = problem
                replica.stage = "dead"
                replica.set_state(ReplicaState.DEAD)
                logger.error("replica %s is dead: %s", replica.replica_id, problem)
                self._replace(replica)
            elif problem and replica.state == ReplicaState.DRAINING and replica.actor is not None:
                # nothing left to drain: its drain (_drain_and_stop) ends now, not at its deadline
                replica.error = problem
                logger.warning("draining replica %s is dead: %s", replica.replica_id, problem)
                ray.kill(replica.actor, no_restart=True)
                replica.actor = None
        self._reconcile()
        await self._publish()

    def _replace(self, dead: Replica) -> None:
        """A serving replica died: retire it (its actor is killed); the next reconcile refills
        its slot (at once, unless the slot's restarts are looping)."""
        import ray

        if self._stopping:
            return
        pool = self.pools[dead.role]
        if dead in pool:
            pool.remove(dead)
            self._retired.append(dead)
        if dead.actor is not None:
            ray.kill(dead.actor, no_restart=True)  # also takes down a hung engine
            dead.actor = None
        self._reconcile()

    def _reconcile(self) -> None:
        """Start replicas into the empty slots of every role, as far as their budget allows; a
        replica that failed to start leaves the pool (for `retired`) when its slot is retried."""
        if self._stopping:
            return
        now = time.monotonic()
        for role in self.config.serving_roles():
            pool = self.pools[role]
            active = {r.slot for r in pool if r.state in (ReplicaState.STARTING, ReplicaState.READY)}
            draining = {r.slot for r in pool if r.state == ReplicaState.DRAINING}
            section = self.config.role(role)
            missing = missing_slots(active, section.replicas, draining, groups=len(section.cpu_bind))
            if missing and not self._placeable(role):
                continue
            for slot in missing:
                refusal = self._budget.refusal((role, slot), now)
                if refusal is not None:
                    if (role, slot, refusal.split()[0]) not in self._refused:
                        self._refused.add((role, slot, refusal.split()[0]))
                        logger.error("not restarting %s slot %d yet: %s", role, slot, refusal)
                    continue
                for failed in [r for r in pool if r.slot == slot and r.state == ReplicaState.DEAD]:
                    pool.remove(failed)
                    self._retired.append(failed)
                replacement = self._add_replica(role, slot)
                logger.info("starting %s in %s slot %d", replacement.replica_id, role, slot)

    def _placement_problem(self, role: RoleName) -> str | None:
        """Why no live Ray node could host a replica of `role` (placement.py); None if one can."""
        import ray

        section = self.config.role(role)
        return unplaceable(section.placement, demand(section.resources, section.placement), ray.nodes())

    def _placeable(self, role: RoleName) -> bool:
        """Whether replicas of `role` can be started now; a role that cannot is reported once
        (logged, and in `status`) until a node that fits joins."""
        problem = self._placement_problem(role)
        if problem is None:
            if self.unplaced.pop(role, None) is not None:
                logger.info("%s replicas can be placed again", role)
            return True
        if self.unplaced.get(role) != problem:
            self.unplaced[role] = problem
            logger.error("cannot place %s replicas: %s (waiting for a node that fits)", role, problem)
        return False

    async def wait_ready(self, timeout_s: float, change: bool = False) -> bool:
        """True once no replica is starting; with `change`, not before the replica table changes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not change and not any(r.state == ReplicaState.STARTING for p in self.pools.values() for r in p):
                return True
            change = False
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.next_publish(remaining):
                return False

    async def next_publish(self, timeout_s: float) -> bool:
        """True at the controller's next publish of the replica table (each monitor pass, each
        change), whatever is starting; False after `timeout_s`: what `status --watch` waits for."""
        async with self._published:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._published.wait()
            except asyncio.TimeoutError:
                return False
        return True

    # -- scaling ------------------------------------------------------------------------

    async def scale(self, role: RoleName, replicas: int) -> dict[str, Any]:
        """An operator's `scale`: refused (ConfigError) where the cluster YAML would be."""
        if role not in self.config.serving_roles():
            raise ConfigError(f"role {role!r} is not served in {self.config.mode} mode")
        candidate = self.config.model_dump()
        candidate["roles"][role]["replicas"] = replicas
        try:
            ClusterConfig.model_validate(candidate)
        except ValidationError as exc:
            raise ConfigError(f"scale {role} {replicas}: " + "; ".join(format_errors(exc))) from None
        return await self.resize(role, replicas)

    async def resize(self, role: RoleName, replicas: int, drain_first: Collection[str] = ()) -> dict[str, Any]:
        """Set `role`'s replica count (the planner's steps stay within its bounds); a smaller one
        drains the replicas named in `drain_first` before any other."""
        async with self._lock:
            # the replica loads first: no await between choosing the replicas to drain and draining them
            inflight = await self._inflight()
            active = [r for r in self.pools[role] if r.state in (ReplicaState.STARTING, ReplicaState.READY)]
            added, draining = [], []
            if replicas > len(active):
                before = {r.replica_id for r in self.pools[role]}
                self.config.role(role).replicas = replicas
                self._reconcile()
                added = [r.replica_id for r in self.pools[role] if r.replica_id not in before]
            if replicas < len(active):
                # Drop those named, then starting replicas, then the least loaded ready ones.
                active.sort(
                    key=lambda r: (
                        r.replica_id not in drain_first,
                        r.state != ReplicaState.STARTING,
                        inflight.get(r.replica_id, 0),
                        -r.index,
                    )
                )
                for replica in active[: len(active) - replicas]:
                    self._budget.forget((role, replica.slot))  # scaled away: not a restart when refilled
                    draining.append(replica.replica_id)
                    replica.set_state(ReplicaState.DRAINING)
                    replica.stage = "draining"
                    self.drain(replica)
            self.config.role(role).replicas = replicas
            await self._publish()
        result = {"role": role, "replicas": replicas, "added": added, "draining": draining}
        if role in self.unplaced:
            result["unplaced"] = self.unplaced[role]
        return result

    def drain(self, replica: Replica) -> None:
        replica.task = asyncio.create_task(self._drain_and_stop(replica))

    async def _drain_and_stop(self, replica: Replica) -> None:
        """No new requests reach it (router excludes DRAINING); stop once it holds nothing."""
        deadline = time.monotonic() + self.config.router.request_timeout_seconds + self.config.kv_transfer.lease_seconds
        while time.monotonic() < deadline and replica.actor is not None and replica.url:
            inflight = (await self._inflight()).get(replica.replica_id, 0)
            stats = (replica.info or {}).get("stats") or {}
            busy = stats.get("running", 0) or stats.get("waiting", 0) or stats.get("kv_cache_usage", 0.0) > 0
            if inflight == 0 and not busy:
                break
            await asyncio.sleep(MONITOR_INTERVAL_S)  # re-check after the monitor's next refresh
        await self._stop_replica(replica)

    async def _stop_replica(self, replica: Replica) -> None:
        import ray

        replica.stage = "stopping"
        if replica.actor is not None:
            try:
                async with asyncio.timeout(60):
                    await replica.actor.shutdown.remote()
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as exc:
                logger.warning("replica %s did not shut down cleanly: %s", replica.replica_id, exc)
            # The monitor may have found it dead meanwhile, and killed it already.
            if replica.actor is not None:
                ray.kill(replica.actor, no_restart=True)
                replica.actor = None
        replica.stage = "stopped"
        replica.set_state(ReplicaState.DEAD)
        pool = self.pools[replica.role]
        if replica in pool:  # (one that died draining may have left it)
            pool.remove(replica)
            self._retired.append(replica)
        await self._publish()

    # -- status -------------------------------------------------------------------------

    async def _ask_router(self, names: tuple[str, ...]) -> tuple[dict[str, Any], str | None]:
        """The router's answers to its methods `names` ({} where there is none), and why it could
        not be asked: a router actor that died or hangs (until another serves: router_keeper.py)
        must not take `status` (the replica table) or `scale` down with it."""
        import ray

        if self.router is None:
            return {}, self.routers.down
        try:
            async with asyncio.timeout(INFO_TIMEOUT_S):
                answers = await asyncio.gather(*(getattr(self.router, name).remote() for name in names))
        except ray.exceptions.RayActorError as exc:
            return {}, f"the router is gone, the endpoint serves nothing ({one_line(exc, 200)})"
        except asyncio.TimeoutError:
            return {}, f"the router did not answer in {INFO_TIMEOUT_S:.0f} s"
        return dict(zip(names, answers, strict=True)), None

    async def _inflight(self) -> dict[str, int]:
        """Requests the router has in flight per replica ({} where it cannot say)."""
        return (await self._ask_router(("inflight",)))[0].get("inflight", {})

    async def status(self) -> dict[str, Any]:
        view, router_error = await self._ask_router(ROUTER_VIEW)
        latency, inflight = view.get("latency", {}), view.get("inflight", {})
        backend = self.config.kv_transfer.backend
        rows = [replica_row(r, latency, inflight, backend) for pool in self.pools.values() for r in pool]
        return {
            "name": self.config.name,
            "endpoint": self.endpoint,
            "router_error": router_error,
            "router_restarts": self.routers.restarts,
            "controller_restarts": self.restarts,
            "router_rss_bytes": view.get("rss_bytes"),
            "mode": self.config.mode,
            "model": self.config.model.served_name,
            "speculative": self.config.speculative.vllm_config() if self.config.speculative else None,
            "uptime_s": time.time() - self.started_at,
            "replicas": rows,
            "unplaced": dict(self.unplaced),
            "routes": view.get("route_decisions", {}),
            "cache": view.get("cache_index", {}),
            "planner": self.planner.last if self.planner is not None else None,
            "retired": [retired_row(r) for r in self._retired],
        }

    def ping(self) -> str:
        return "ok"

    async def shutdown(self) -> None:
        self._stopping = True
        if self._recovery is not None:
            self._recovery.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
        if self.planner is not None:
            self.planner.stop()
        await self.routers.stop()
        replicas = [r for pool in self.pools.values() for r in pool]
        for r in replicas:
            if r.task is not None and not r.task.done():
                r.task.cancel()
        await asyncio.gather(*(self._stop_replica(r) for r in replicas), return_exceptions=True)
        end_cluster(self.config.name, self.config.ray.namespace)  # what a restart left


def _reconstructed() -> bool:
    """Whether this is a controller Ray restarted (False outside a Ray actor: unit tests)."""
    import ray

    context = ray.get_runtime_context() if ray.is_initialized() else None
    return bool(context and context.get_actor_id() and context.was_current_actor_reconstructed)
