"""The router actor, kept: the controller starts it, and starts another where it died.

The router is the cluster's one endpoint. Its actor dying (the OOM killer, a crash, its node lost)
left the endpoint answering nothing until an operator ran `down` and `up`, while every replica
behind it still ran. Now the keeper hands the router the replica table for the controller (its
monitor publishes each second) and so finds a router dead (Ray's actor error; not a node's
connection breaking for a moment) or hung (HEALTH_FAILURES updates in a row unanswered, as a
replica's health checks: its event loop stuck, its process stopped); it kills that one and starts
a new router with the same settings (API keys read afresh) on the same address and port, which
serves with the replica table from its first request. Restarts are paced and budgeted as a
replica slot's are (reconcile.RestartBudget); `status` says why there is no router while there is
none, and how often it was restarted.
Requests the dead router held are lost to their clients (their engine requests end as the
connections drop; a lease they held expires).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pdcluster.config import ClusterConfig
from pdcluster.errors import one_line
from pdcluster.keys import engine_http_token
from pdcluster.logs import WarnOnce
from pdcluster.orchestrator.engines import generation_defaults
from pdcluster.orchestrator.placement import orchestrator_options
from pdcluster.orchestrator.reconcile import HEALTH_FAILURES, RestartBudget
from pdcluster.orchestrator.recovery import router_name

logger = logging.getLogger(__name__)

ROUTER_SLOT = ("router", 0)  # the router's key in the controller's restart budget
# A new router that does not serve by then (no node to place it on: Ray keeps it pending) is
# killed; the next monitor pass tries again, as the budget allows.
RESTART_TIMEOUT_S = 300.0
UPDATE_TIMEOUT_S = 10.0  # a replica-table update the router has not taken by then is unanswered
STOP_TIMEOUT_S = 30.0  # the router's own stop: its open requests' grace and cut (router/app.py)


def router_settings(config: ClusterConfig, api_keys: list[str], secret: str):
    """The router's settings from the cluster YAML, its API keys and the cluster secret."""
    from pdcluster.orchestrator.router import RouterSettings

    return RouterSettings(
        model_name=config.model.served_name,
        mode=config.mode,
        policy=config.router.policy,
        api_keys=api_keys,
        request_timeout_s=config.router.request_timeout_seconds,
        max_body_bytes=config.router.max_body_bytes,
        max_model_len=config.model.max_model_len,
        tokenizer_path=config.model.tokenizer or config.model.path,
        first_token_from_prefill=config.router.first_token_from_prefill,
        decode_ahead=config.router.decode_ahead,
        migration_limit=config.router.migration_limit,
        local_prefill_max_tokens=config.router.local_prefill_max_tokens,
        local_prefill_queue_tokens=config.router.local_prefill_queue_tokens,
        slo_window_s=config.autoscale.window_seconds,
        abandon_after_prefill_rate=config.router.fault_injection.abandon_after_prefill_rate,
        engine_token=engine_http_token(secret),
        generation_defaults=generation_defaults(config.model.path),
    )


class RouterKeeper:
    """The router actor of one cluster: started, found dead, started again."""

    def __init__(
        self,
        config: ClusterConfig,
        settings: Callable[[], Any],
        rows: Callable[[], list[dict[str, Any]]],
        budget: RestartBudget,
    ) -> None:
        self.config = config
        self._settings = settings  # called at each start
        self._rows = rows  # the replica table: handed to the router, and a new one starts with it
        self._budget = budget
        self.actor = None
        self.endpoint: str | None = None
        self.down: str | None = None  # why no router serves now (None: one does, or none was started)
        self.restarts = 0
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._unanswered = 0  # replica-table updates in a row the router did not take in time
        self._warn_once = WarnOnce(logger)

    async def start(self, host: str, port: int) -> str:
        """Start a router serving on host:port with the current replica table; its endpoint."""
        import ray

        # Here, not at the top: every `pdcluster status` imports the controller (Ray loads its
        # class to make its handle), and the router's modules import torch (compat).
        from pdcluster.orchestrator.router import RouterActor

        self._budget.started(ROUTER_SLOT, time.monotonic())
        actor = (
            ray.remote(RouterActor)
            .options(
                name=router_name(self.config.name),
                lifetime="detached",  # it serves on while the controller is down (recovery.py)
                max_concurrency=1000,
                **orchestrator_options(self.config.router.placement),
            )
            .remote(self._settings())
        )
        try:
            endpoint = await actor.start.remote(host, port, self._rows())
        except BaseException:
            ray.kill(actor, no_restart=True)  # one that failed to serve holds its name and port
            raise
        self.actor, self.endpoint = actor, endpoint
        return endpoint

    def adopt(self, actor, endpoint: str | None, restarts: int) -> None:
        """A restarted controller takes back the router its last run kept (`actor`; None: it is
        gone, and a new one is started on `endpoint`)."""
        self.endpoint, self.restarts = endpoint, restarts
        if actor is not None:
            self.actor = actor
            return
        self.down = "the router is gone (it went while the controller was down); a new one is starting"
        logger.error("router gone while the controller was down; starting a new one at %s", endpoint)
        self.keep()

    async def publish(self) -> None:
        """Hand the router the replica table; replace a router found dead or hung."""
        import ray

        router = self.actor
        if router is not None:
            try:
                async with asyncio.timeout(UPDATE_TIMEOUT_S):
                    await router.update_replicas.remote(self._rows())
                if router is self.actor:
                    self._unanswered = 0
            except asyncio.TimeoutError:
                self._unanswered_by(router)
            except ray.exceptions.ActorUnavailableError as exc:  # its node's connection broke: not a death
                self._warn_once("unavailable", "cannot publish the replicas to the router: %s", one_line(exc, 200))
            except ray.exceptions.RayActorError as exc:  # its actor is gone
                self.lost(exc, router)
            except ray.exceptions.RayError as exc:
                self._warn_once("error", "cannot publish the replicas to the router: %s", one_line(exc, 200))
        self.keep()  # a router that died, or whose replacement failed to start

    def _unanswered_by(self, router) -> None:
        if router is not self.actor:
            return  # (one replaced meanwhile)
        self._unanswered += 1
        if self._unanswered < HEALTH_FAILURES:
            logger.warning("the router did not take the replica table in %.0f s", UPDATE_TIMEOUT_S)
            return
        hung = f"{self._unanswered} replica-table updates in a row unanswered in {UPDATE_TIMEOUT_S:.0f} s"
        self.lost(TimeoutError(hung), router)

    def lost(self, error: BaseException, router) -> None:
        """The router actor `router` was found dead or hung: kill it and start another (now, or
        once the budget allows). One replaced meanwhile is left alone."""
        import ray

        if router is not self.actor:
            return
        dead, self.actor, self._unanswered = self.actor, None, 0
        ray.kill(dead, no_restart=True)  # a hung one too; its name is free for the new one
        self.down = f"the router is gone ({one_line(error, 200)}); a new one is starting"
        logger.error("router gone: %s; starting a new one at %s", one_line(error, 300), self.endpoint)
        self.keep()

    def keep(self) -> None:
        """Start a new router where the last one died, as far as the restart budget allows (each
        monitor pass asks)."""
        starting = self._task is not None and not self._task.done()
        if self._stopped or self.actor is not None or self.down is None or starting:
            return
        refusal = self._budget.refusal(ROUTER_SLOT, time.monotonic())
        if refusal is not None:
            self._warn_once(refusal.split()[0], "not restarting the router yet: %s", refusal)
            return
        self._task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        port = urlsplit(self.endpoint or "").port or self.config.router.port  # the bound one (router.port 0)
        try:
            async with asyncio.timeout(RESTART_TIMEOUT_S):
                await self.start(self.config.router.host, port)
        except Exception as exc:  # noqa: BLE001 - a failed start is tried again by a later pass
            self.down = f"the router is gone; a new one failed to start ({one_line(exc, 200)}); trying again"
            logger.error("a new router failed to start: %s", one_line(exc, 300))
            return
        self.down = None
        self.restarts += 1
        logger.warning("router restarted at %s (%d restart(s))", self.endpoint, self.restarts)

    async def stop(self) -> None:
        """Stop the router (and a start of one under way)."""
        import ray

        self._stopped = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.actor is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.actor.stop.remote()
            except ray.exceptions.RayActorError as exc:
                logger.warning("router did not stop cleanly: %s", one_line(exc, 300))
            except asyncio.TimeoutError:
                logger.warning("router did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            ray.kill(self.actor, no_restart=True)
            self.actor = None
