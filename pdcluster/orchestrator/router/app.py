"""The router's HTTP side: the FastAPI app and its routes, the API-key guard, the server's start
and stop, and the Ray actor that hosts it all (the controller creates one)."""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdcluster.addresses import binds_every_address, node_ip
from pdcluster.errors import ConfigError, NoReplicaError, PDClusterError
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.policies import ReplicaLoad
from pdcluster.orchestrator.router.handoff import PhaseRunner
from pdcluster.orchestrator.router.pool import ReplicaPool
from pdcluster.orchestrator.router.relay import RelayResponse
from pdcluster.orchestrator.router.requests import (
    MAX_REQUEST_ID_CHARS,
    BadRequest,
    PromptTokens,
    error_response,
    read_body,
    validate,
)
from pdcluster.orchestrator.router.settings import RouterSettings
from pdcluster.orchestrator.router.transport import AsyncioTransport

logger = logging.getLogger(__name__)
# What requests still open when the router stops (`down`) get to end, and then to be cut.
STOP_GRACE_S = 10.0
STOP_CUT_S = 5.0


class Router:
    def __init__(self, settings: RouterSettings):
        if not settings.engine_token:
            raise ValueError("a router needs the engine key (RouterSettings.engine_token) to reach replicas")
        self.settings = settings
        self.metrics = RouterMetrics(lambda: self.pool.rows, lambda: self.pool.cache.summary(), settings.slo_window_s)
        self.pool = ReplicaPool(settings.policy, self.metrics)
        self.tokens = PromptTokens(settings.tokenizer_path)
        self.phases = PhaseRunner(settings, self.pool, self.metrics)
        self._keys = [k.encode() for k in settings.api_keys]
        self.http: httpx.AsyncClient | None = None
        self._transport: AsyncioTransport | None = None
        self.app = self._build_app()
        self._server = None
        self._serve_task: asyncio.Task | None = None
        self.url: str | None = None

    # -- membership (controller -> router) -------------------------------------------------

    @property
    def replicas(self) -> dict[str, ReplicaLoad]:
        return self.pool.replicas

    def update_replicas(self, rows: list[dict[str, Any]]) -> None:
        """The controller's replica table. Requests still on a replica that left it (found dead)
        get their connections cut at once: streams then move to another decode replica, other
        requests recover or end, none waits for a read timeout."""
        for url in self.pool.update(rows):
            if self._transport is not None:
                cut = self._transport.cut(url, "replica declared dead by the controller")
                logger.warning("replica at %s left with requests on it: %d connections cut", url, cut)

    def inflight(self) -> dict[str, int]:
        return self.pool.inflight()

    def latency(self) -> dict[str, Any]:
        return {rid: w.summary() for rid, w in self.metrics.windows.items()}

    def ready_roles(self) -> dict[str, int]:
        return self.pool.ready_roles()

    def is_ready(self) -> bool:
        """Whether requests can be served: decode serves them alone while no prefill is ready."""
        return self.ready_roles().get("decode" if self.settings.disaggregated else "aggregated", 0) > 0

    def cache_index(self) -> dict[str, Any]:
        """The routing policy and, under cache_aware, what the router knows of each replica's cache."""
        cache = self.pool.cache
        return {"policy": self.pool.policy.name, "hashing": cache.hashing, "replicas": cache.summary()}

    def planner(self, decision: dict[str, Any]) -> None:
        """The SLO planner's latest decision (orchestrator/autoscale.py), for /metrics."""
        for role, action in decision["actions"]:
            self.metrics.planner_decisions.labels(role, action, decision["rule"]).inc()
        if decision["rule"] == "unplaceable":
            self.metrics.planner_decisions.labels(decision["role"], "unplaceable", decision["rule"]).inc()
        for kind in ("desired", "actual"):
            for role, count in decision[kind].items():
                self.metrics.planner_replicas.labels(role, kind).set(count)

    def route_decisions(self) -> dict[str, int]:
        """Disaggregated requests so far by path (`pd`, `decode`, `local_prefill`, `local_queue`), as /metrics counts them."""
        counts = {}
        for metric in self.metrics.routes.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["path"]] = int(sample.value)
        return counts

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> str:
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:  # in use, or not an address of this node: the operator's to change
            sock.close()
            raise ConfigError(
                f"router.port {port} on {host} cannot be bound: {exc.strerror or exc} "
                "(choose another router.port, or 0 for any free port)"
            ) from None
        sock.listen(2048)
        sock.setblocking(False)
        self.tokens.load_in_background()
        self._transport = AsyncioTransport(httpx.Limits(max_connections=2048, max_keepalive_connections=256))
        self.http = self.phases.http = self.pool.cache.http = httpx.AsyncClient(
            # Every call to a replica carries the engine key its HTTP app requires (http_auth.py).
            headers={"Authorization": f"Bearer {self.settings.engine_token}"},
            timeout=httpx.Timeout(self.settings.request_timeout_s, connect=5.0),
            transport=self._transport,
        )
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        # Bound to every address: the endpoint clients can reach is this node's address.
        shown = node_ip() if binds_every_address(host) else host
        self.url = f"http://{shown}:{sock.getsockname()[1]}"
        logger.info("router listening on %s", self.url)
        return self.url

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop serving. Open requests get `grace_s` to end; then they are cut as if their clients
        had left (each replica's request abandoned, counted cancelled), and only then do the
        connections to the replicas close: a request left running on a closed client failed there."""
        if self._server is not None:
            # uvicorn's own grace period: past it, it cancels the open requests' tasks
            self._server.config.timeout_graceful_shutdown = grace_s
            self._server.should_exit = True
            if self._serve_task is not None:
                await asyncio.wait({self._serve_task}, timeout=grace_s + STOP_CUT_S)
            # uvicorn returns once it cancelled them: their ends (closing each relay) run after
            cut = set(self._server.server_state.tasks)
            if cut:
                await asyncio.wait(cut, timeout=STOP_CUT_S)
        await self.pool.cache.close()
        if self.http is not None:
            await self.http.aclose()

    # -- HTTP app --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdcluster router", docs_url=None, redoc_url=None)

        # A plain ASGI middleware: Starlette's @app.middleware("http") passes every chunk of a
        # streamed response through a memory stream and a second task.
        app.add_middleware(_ApiKeyGuard, router=self)

        # Every answer the router gives is OpenAI-style JSON: an unknown path or method too, and
        # a failure of the router itself (its own bug: logged with the traceback).
        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException):
            message = f"{exc.detail} ({request.method} {request.url.path})"
            return error_response(exc.status_code, message, "invalid_request_error")

        @app.exception_handler(Exception)
        async def router_error(request: Request, exc: Exception):
            logger.error("router: %s %s failed", request.method, request.url.path, exc_info=exc)
            return error_response(500, f"internal router error: {type(exc).__name__}", "internal_error")

        @app.get("/health")
        async def health():
            if self.is_ready():
                return {"status": "ok", "ready": self.ready_roles()}
            return JSONResponse(status_code=503, content={"status": "unavailable", "ready": self.ready_roles()})

        @app.get("/v1/models")
        async def models():
            entry = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "pdcluster"}
            if self.settings.max_model_len:
                entry["max_model_len"] = self.settings.max_model_len
            return {"object": "list", "data": [entry]}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.handle(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.handle(request, "chat")

        return app

    def authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode()
        return any(hmac.compare_digest(presented, key) for key in self._keys)

    # -- request path ----------------------------------------------------------------------

    async def handle(self, request: Request, kind: str) -> Response:
        """One client request: validated here, then through its phases (handoff.py); failures
        that end it before its answer began become OpenAI-style errors."""
        started = time.perf_counter()
        try:
            body = await read_body(request, self.settings.max_body_bytes)
            validate(body, kind, self.settings)
        except BadRequest as exc:
            self.metrics.requests.labels(kind, "client_error").inc()
            return exc.response()
        except ClientDisconnect:  # gone while it sent its body: not the router's failure
            self.metrics.requests.labels(kind, "cancelled").inc()
            return Response(status_code=499)  # nobody reads it
        h = self.phases.handoff(body, kind, started)
        # The client's own id (as vLLM takes it: the header, else the body's request_id) names the
        # request on the engines and in its answer's id ("cmpl-<id>"), as one engine answers it.
        client_id = request.headers.get("x-request-id") or body.get("request_id")
        if (
            isinstance(client_id, str)
            and 0 < len(client_id) <= MAX_REQUEST_ID_CHARS
            and client_id.isascii()  # a header value (httpx sends ASCII only)
            and client_id.isprintable()
        ):
            h.client_request_id = h.request_id = client_id
        try:
            if self.pool.policy.name == "cache_aware":
                h.prompt = await self.tokens.prompt(body, kind)
                await self.pool.cache.prepare(h.prompt)
                h.tokens = h.prompt.count
            elif self.phases.wants_prompt_ids(h):  # a continuation sent ahead carries them
                h.prompt = await self.tokens.prompt(body, kind)
                h.tokens = h.prompt.count
            else:
                h.tokens = await self.tokens.count(body, kind)
            # A stream's response starts once its first phases are done; Starlette watches its
            # client from then on. Until then, and for a whole non-streamed request, we do.
            return await self._watched(request, h, None if h.stream else self.settings.request_timeout_s)
        except NoReplicaError as exc:
            h.finish("no_replica", e2e=False)
            return error_response(503, str(exc), "service_unavailable")
        except PDClusterError as exc:
            h.finish("upstream_error", e2e=False)
            return error_response(exc.http_status, str(exc), exc.error_type)
        except httpx.TimeoutException as exc:
            h.finish("timeout", e2e=False)
            return error_response(504, f"upstream replica timed out: {type(exc).__name__}", "timeout")
        except httpx.HTTPError as exc:
            h.finish("upstream_error", e2e=False)
            return error_response(502, f"upstream replica failed: {type(exc).__name__}: {exc}", "upstream_error")

    async def _watched(self, request: Request, h, timeout_s: float | None) -> Response:
        """The request's response, abandoned on the engines when its client goes away first
        (a stream: before its response starts, while its prefill runs or queues; a non-streamed
        request: before its answer): cancelling it closes the engines' connections, and vLLM
        aborts a request whose connection closed. A non-streamed request is also bounded by
        the total deadline (router.request_timeout_seconds; a stream's relay keeps it)."""
        serving = asyncio.ensure_future(self.phases.serve(h))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({serving, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if serving in done:
            return serving.result()
        serving.cancel()
        # Not gather: a cancel of this task would be passed on to `serving` again, and a second
        # cancel breaks off httpcore's close of the engine's connection.
        await asyncio.wait({serving})
        if not serving.cancelled() and serving.exception() is None and isinstance(serving.result(), RelayResponse):
            await serving.result().relay.close()  # it returned as it was cancelled: nobody will stream it
        if gone in done:
            h.finish("cancelled", e2e=False)
            return Response(status_code=499)  # nobody reads it: the client is gone
        h.finish("timeout", e2e=False)
        return error_response(
            504, f"request exceeded router.request_timeout_seconds ({self.settings.request_timeout_s:g} s)", "timeout"
        )


async def _disconnected(request: Request) -> None:
    """Returns once the client of a request whose body was read has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


class _ApiKeyGuard:
    """401 for requests without a valid API key (when keys are configured), /health exempt."""

    def __init__(self, app: Any, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and self.router._keys
            and scope["path"] != "/health"
            and not self.router.authorized(Request(scope))
        ):
            response = error_response(
                401,
                "Missing or invalid API key (Authorization: Bearer <key>).",
                "authentication_error",
                "invalid_api_key",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def freeze_startup_heap() -> None:
    """Keep what the router process holds once it listens out of the garbage collector's full
    passes. Such a pass walks every tracked object (its imports leave ~90k) with the event loop
    stopped, so every stream the router relays stalls for it, on a busy core for tens of ms. vLLM
    freezes its API server's heap the same way (vllm.utils.gc_utils.freeze_gc_heap, from its app's
    lifespan, which our engine hosts run); what the router allocates later is collected as before."""
    gc.collect()
    gc.freeze()
    logger.info("router: startup heap frozen (%d objects)", gc.get_freeze_count())


class RouterActor:
    """Ray actor wrapper: the router's event loop is the actor's."""

    def __init__(self, settings: RouterSettings):
        from pdcluster.logs import setup_logging

        setup_logging()
        self.router = Router(settings)

    async def start(self, host: str, port: int, rows: list[dict[str, Any]] | None = None) -> str:
        """Serve on host:port; `rows`: the replica table to route by from the first request (a
        router started in place of one that died: orchestrator/router_keeper.py)."""
        url = await self.router.start(host, port)
        if rows:
            self.router.update_replicas(rows)  # before the server's task first runs
        freeze_startup_heap()
        return url

    async def update_replicas(self, rows: list[dict[str, Any]]) -> None:
        self.router.update_replicas(rows)  # on the router's event loop: it starts and cuts its tasks

    def inflight(self) -> dict[str, int]:
        return self.router.inflight()

    def latency(self) -> dict[str, Any]:
        return self.router.latency()

    def route_decisions(self) -> dict[str, int]:
        return self.router.route_decisions()

    def cache_index(self) -> dict[str, Any]:
        return self.router.cache_index()

    def slo(self) -> dict[str, float | None]:
        return self.router.metrics.slo()

    def planner(self, decision: dict[str, Any]) -> None:
        self.router.planner(decision)

    def rss_bytes(self) -> int:
        from pdcluster.engine.actor import process_tree_rss

        return process_tree_rss()

    async def stop(self) -> None:
        await self.router.stop()
