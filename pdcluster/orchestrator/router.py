"""The router: one OpenAI-compatible HTTP endpoint in front of the replica pools.

A request's life (disaggregated mode):
  1. validate (auth, size, JSON, model, parameters the P/D path cannot honour) -> 4xx OpenAI JSON
  2. prefill: choose a prefill replica (policy), POST a copy with max_tokens=1, stream=false and
     kv_transfer_params={"do_remote_decode": true}; a prefill error goes straight back to the
     client; a replica that cannot be reached is retried on another one
  3. decode: choose a decode replica, POST the original request plus the returned
     kv_transfer_params, and relay its answer (SSE stream or JSON) to the client
Aggregated mode skips 2 and sends the request to one replica. Replica membership and state come
from the controller (`update_replicas`); only READY replicas are chosen, and in-flight counts let
the controller drain a replica before stopping it.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdcluster.errors import NoReplicaError, PDClusterError, ReplicaError
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.policies import ReplicaLoad, make_policy
from pdcluster.orchestrator.replicas import ReplicaState

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass
class RouterSettings:
    model_name: str
    mode: str = "disaggregated"
    policy: str = "least_loaded"
    api_keys: list[str] = field(default_factory=list)
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 << 20
    max_model_len: int | None = None
    tokenizer_path: str | None = None
    phase_attempts: int = 3


def error_response(status: int, message: str, err_type: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI-style error body."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": param, "code": code or status}},
    )


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.err_type = err_type
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.err_type, self.code, self.param)


class Router:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.policy = make_policy(settings.policy)
        self.replicas: dict[str, ReplicaLoad] = {}
        self.engine_rows: list[dict[str, Any]] = []
        self.metrics = RouterMetrics(lambda: self.engine_rows)
        self._keys = [k.encode() for k in settings.api_keys]
        self._tokenizer = None
        self.http: httpx.AsyncClient | None = None
        self.app = self._build_app()
        self._server = None
        self._serve_task: asyncio.Task | None = None
        self.url: str | None = None

    # -- membership (controller -> router) -------------------------------------------------

    def update_replicas(self, rows: list[dict[str, Any]]) -> None:
        """Replace the replica table: rows of {replica_id, role, url, state, node, stats}."""
        seen = set()
        for row in rows:
            rid = row["replica_id"]
            seen.add(rid)
            current = self.replicas.get(rid)
            if current is None:
                current = self.replicas[rid] = ReplicaLoad(rid, row["role"], row["url"])
            current.url = row["url"]
            current.state = ReplicaState(row["state"])
            current.node = row.get("node", "")
            current.meta = row
        for rid in list(self.replicas):
            if rid not in seen and self.replicas[rid].inflight_requests == 0:
                del self.replicas[rid]
        self.engine_rows = [dict(row) for row in rows]

    def inflight(self) -> dict[str, int]:
        return {rid: r.inflight_requests for rid, r in self.replicas.items()}

    def latency(self) -> dict[str, Any]:
        return {rid: w.summary() for rid, w in self.metrics.windows.items()}

    def ready_roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.replicas.values():
            if r.state == ReplicaState.READY:
                counts[r.role] = counts.get(r.role, 0) + 1
        return counts

    def is_ready(self) -> bool:
        ready = self.ready_roles()
        roles = ("prefill", "decode") if self.settings.mode == "disaggregated" else ("aggregated",)
        return all(ready.get(role, 0) > 0 for role in roles)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> str:
        import socket

        import uvicorn

        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.settings.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        logger.info("router listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._serve_task is not None:
                await asyncio.wait({self._serve_task}, timeout=10)
        if self.http is not None:
            await self.http.aclose()

    # -- HTTP app --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdcluster router", docs_url=None, redoc_url=None)

        @app.middleware("http")
        async def guard(request: Request, call_next):
            path = request.url.path
            if self._keys and path != "/health" and not self._authorized(request):
                return error_response(401, "Missing or invalid API key (Authorization: Bearer <key>).", "authentication_error", "invalid_api_key")
            return await call_next(request)

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

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode()
        return any(hmac.compare_digest(presented, key) for key in self._keys)

    async def _read_body(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"Request body exceeds {limit} bytes.", status=413, code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"Request body exceeds {limit} bytes.", status=413, code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("Request body is not valid UTF-8.") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"Request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).") from None
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object.")
        return body

    def _validate(self, body: dict[str, Any], kind: str) -> None:
        model = body.get("model")
        if model is None:
            raise BadRequest("'model' is required.", param="model")
        if model != self.settings.model_name:
            raise BadRequest(
                f"The model '{model}' does not exist; this endpoint serves '{self.settings.model_name}'.",
                param="model", status=404, code="model_not_found",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean.", param="stream")
        n = body.get("n", 1)
        if n is not None and n != 1 and self.settings.mode == "disaggregated":
            raise BadRequest("'n' > 1 is not supported by the disaggregated path.", param="n")
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadRequest(f"'{key}' must be an integer.", param=key)
            if value < 1:
                raise BadRequest(f"'{key}' must be at least 1.", param=key)
            if self.settings.max_model_len and value > self.settings.max_model_len:
                raise BadRequest(f"'{key}' ({value}) exceeds the model's context length ({self.settings.max_model_len}).", param=key)
        if "kv_transfer_params" in body:
            raise BadRequest("'kv_transfer_params' is set by the router, not by clients.", param="kv_transfer_params")
        if kind == "completions":
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest("'prompt' is required.", param="prompt")
            if prompt == "" or prompt == [] or prompt == [[]]:
                raise BadRequest("'prompt' must not be empty.", param="prompt")
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list.", param="messages")

    def _prompt_tokens(self, body: dict[str, Any], kind: str) -> int:
        """Estimated prompt tokens, for load balancing only (the engine counts exactly)."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        else:
            text = json.dumps(body.get("messages"))
        if self._tokenizer is None and self.settings.tokenizer_path:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer_path)
        if self._tokenizer is not None:
            return len(self._tokenizer(text)["input_ids"])
        return max(1, len(text) // 4)

    # -- request path ----------------------------------------------------------------------

    async def handle(self, request: Request, kind: str) -> Response:
        started = time.perf_counter()
        try:
            body = await self._read_body(request)
            self._validate(body, kind)
        except BadRequest as exc:
            self.metrics.requests.labels(kind, "client_error").inc()
            return exc.response()
        try:
            tokens = self._prompt_tokens(body, kind)
            if self.settings.mode == "disaggregated":
                return await self._disaggregated(body, kind, tokens, started)
            return await self._single(body, kind, tokens, started)
        except NoReplicaError as exc:
            self.metrics.requests.labels(kind, "no_replica").inc()
            return error_response(503, str(exc), "service_unavailable")
        except PDClusterError as exc:
            self.metrics.requests.labels(kind, "upstream_error").inc()
            return error_response(exc.http_status, str(exc), exc.error_type)

    async def _post_phase(self, role: str, path: str, body: dict[str, Any], tokens: int) -> tuple[ReplicaLoad, httpx.Response]:
        """Non-streamed call to a replica of `role`, retried on another one if unreachable."""
        assert self.http is not None
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self.settings.phase_attempts):
            replica = self.policy.choose(list(self.replicas.values()), role, exclude=tried)
            tried.add(replica.replica_id)
            self._enter(replica, tokens)
            try:
                return replica, await self.http.post(replica.url + path, json=body)
            except CONNECT_ERRORS as exc:
                last = exc
                logger.warning("%s replica %s unreachable (%s); trying another", role, replica.replica_id, exc)
                if attempt + 1 < self.settings.phase_attempts:
                    self.metrics.retries.labels(role).inc()
            finally:
                self._leave(replica, tokens)
        raise ReplicaError(f"no {role} replica could take the request: {last}")

    def _enter(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests += 1
        replica.inflight_prompt_tokens += tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    def _leave(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests -= 1
        replica.inflight_prompt_tokens -= tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    async def _disaggregated(self, body: dict[str, Any], kind: str, tokens: int, started: float) -> Response:
        path = ENDPOINTS[kind]
        prefill_body = copy.deepcopy(body)
        prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill_body["max_tokens"] = 1
        if kind == "chat":
            prefill_body["max_completion_tokens"] = 1
        for key in ("stream_options", "logprobs", "top_logprobs", "echo"):
            prefill_body.pop(key, None)
        p_started = time.perf_counter()
        prefill, p_resp = await self._post_phase("prefill", path, prefill_body, tokens)
        p_elapsed = time.perf_counter() - p_started
        self.metrics.prefill.observe(p_elapsed)
        self.metrics.window(prefill.replica_id).phase.add(p_elapsed)
        if p_resp.status_code != 200:
            self.metrics.requests.labels(kind, "client_error" if p_resp.status_code < 500 else "upstream_error").inc()
            return Response(p_resp.content, status_code=p_resp.status_code, media_type="application/json")
        params = p_resp.json().get("kv_transfer_params")
        if not params:
            raise ReplicaError(f"prefill replica {prefill.replica_id} returned no kv_transfer_params")
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = params
        return await self._relay("decode", path, decode_body, kind, tokens, started)

    async def _single(self, body: dict[str, Any], kind: str, tokens: int, started: float) -> Response:
        return await self._relay("aggregated", ENDPOINTS[kind], body, kind, tokens, started)

    async def _relay(self, role: str, path: str, body: dict[str, Any], kind: str, tokens: int, started: float) -> Response:
        """Send the request to a `role` replica and relay its answer (stream or JSON)."""
        assert self.http is not None
        if not body.get("stream"):
            replica, resp = await self._post_phase(role, path, body, tokens)
            elapsed = time.perf_counter() - started
            self.metrics.e2e.observe(elapsed)
            outcome = "ok" if resp.status_code == 200 else ("client_error" if resp.status_code < 500 else "upstream_error")
            self.metrics.requests.labels(kind, outcome).inc()
            return Response(resp.content, status_code=resp.status_code, media_type="application/json")

        replica = self.policy.choose(list(self.replicas.values()), role)
        self._enter(replica, tokens)
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", replica.url + path, json=body), stream=True
            )
        except CONNECT_ERRORS as exc:
            self._leave(replica, tokens)
            raise ReplicaError(f"{role} replica {replica.replica_id} unreachable: {exc}") from exc
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self._leave(replica, tokens)
            self.metrics.requests.labels(kind, "client_error" if upstream.status_code < 500 else "upstream_error").inc()
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(
            self._stream(upstream, replica, tokens, kind, started),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _stream(self, upstream: httpx.Response, replica: ReplicaLoad, tokens: int, kind: str, started: float) -> AsyncIterator[bytes]:
        window = self.metrics.window(replica.replica_id)
        last_token: float | None = None
        outcome = "ok"
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data: ") and _has_token(line):
                    now = time.perf_counter()
                    if last_token is None:
                        ttft = now - started
                        self.metrics.ttft.observe(ttft)
                        window.ttft.add(ttft)
                    else:
                        itl = now - last_token
                        self.metrics.itl.observe(itl)
                        window.itl.add(itl)
                    last_token = now
                yield (line + "\n").encode()
        except (httpx.HTTPError, OSError) as exc:
            outcome = "upstream_error"
            logger.error("stream from %s broke: %s", replica.replica_id, exc)
            error = {"error": {"message": f"upstream replica {replica.replica_id} failed mid-stream: {exc}", "type": "upstream_error", "code": 502}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        except asyncio.CancelledError:
            outcome = "cancelled"  # client went away; closing upstream aborts the engine request
            raise
        finally:
            await upstream.aclose()
            self._leave(replica, tokens)
            self.metrics.e2e.observe(time.perf_counter() - started)
            self.metrics.requests.labels(kind, outcome).inc()


def _has_token(line: str) -> bool:
    """Does this SSE data line carry generated text (not the role header, usage or [DONE])?"""
    payload = line[6:]
    if payload.startswith("[DONE]"):
        return False
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return False
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


class RouterActor:
    """Ray actor wrapper: the router's event loop is the actor's."""

    def __init__(self, settings: RouterSettings):
        from pdcluster.logs import setup_logging

        setup_logging()
        self.router = Router(settings)

    async def start(self, host: str, port: int) -> str:
        return await self.router.start(host, port)

    def update_replicas(self, rows: list[dict[str, Any]]) -> None:
        self.router.update_replicas(rows)

    def inflight(self) -> dict[str, int]:
        return self.router.inflight()

    def latency(self) -> dict[str, Any]:
        return self.router.latency()

    async def stop(self) -> None:
        await self.router.stop()
