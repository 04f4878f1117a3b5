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
import functools
import hmac
import json
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdcluster.errors import NoReplicaError, PDClusterError, ReplicaError
from pdcluster.orchestrator import continuation
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.policies import ReplicaLoad, make_policy
from pdcluster.orchestrator.replicas import ReplicaState

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Prompts up to this many characters (~1k tokens, ~1 ms) are tokenized on the event loop;
# longer ones in a thread (the fast tokenizer releases the GIL while it encodes).
INLINE_TOKENIZE_CHARS = 4096
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
    first_token_from_prefill: bool = True  # router.first_token_from_prefill (continuation.py)
    abandon_after_prefill_rate: float = 0.0  # fault injection (router.fault_injection)


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


class ReplicaUnreachable(Exception):
    """No response came back from a replica (connection refused/reset before an answer)."""

    def __init__(self, replica_id: str, detail: str):
        super().__init__(f"replica {replica_id} unreachable: {detail}")
        self.replica_id = replica_id


class Router:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.policy = make_policy(settings.policy)
        self.replicas: dict[str, ReplicaLoad] = {}
        self.engine_rows: list[dict[str, Any]] = []
        self.metrics = RouterMetrics(lambda: self.engine_rows)
        self._keys = [k.encode() for k in settings.api_keys]
        self._faults = random.Random(0)
        self._tokenizer = None
        self._tokenizer_loading: asyncio.Future | None = None
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

        if self.settings.tokenizer_path:
            self._tokenizer_loading = asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)

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

        # A plain ASGI middleware: Starlette's @app.middleware("http") passes every chunk of a
        # streamed response through a memory stream and a second task.
        app.add_middleware(_ApiKeyGuard, router=self)

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

    async def _prompt_tokens(self, body: dict[str, Any], kind: str) -> int:
        """Estimated prompt tokens, for load balancing only (the engine counts exactly).

        Counted with the model's tokenizer once it has loaded (in the background from start());
        long texts are tokenized off the event loop so that other streams keep flowing."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        else:
            text = json.dumps(body.get("messages"))
        tokenizer = self._tokenizer
        if tokenizer is None:
            return max(1, len(text) // 4)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return len(tokenizer(text)["input_ids"])
        return len((await asyncio.to_thread(tokenizer, text))["input_ids"])

    def _load_tokenizer(self) -> None:
        """Runs in a thread from start(): importing transformers and loading a tokenizer takes
        seconds, which on the event loop would stall every request that arrived meanwhile."""
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer_path)
        except (OSError, ValueError, ImportError) as exc:
            logger.warning(
                "router: tokenizer %s did not load (%s); prompt sizes are estimated from their length",
                self.settings.tokenizer_path, exc,
            )

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
            tokens = await self._prompt_tokens(body, kind)
            if self.settings.mode == "disaggregated":
                return await self._disaggregated(body, kind, tokens, started)
            return await self._single(body, kind, tokens, started)
        except NoReplicaError as exc:
            self.metrics.requests.labels(kind, "no_replica").inc()
            return error_response(503, str(exc), "service_unavailable")
        except PDClusterError as exc:
            self.metrics.requests.labels(kind, "upstream_error").inc()
            return error_response(exc.http_status, str(exc), exc.error_type)
        except httpx.TimeoutException as exc:
            self.metrics.requests.labels(kind, "timeout").inc()
            return error_response(504, f"upstream replica timed out: {type(exc).__name__}", "timeout")
        except httpx.HTTPError as exc:
            self.metrics.requests.labels(kind, "upstream_error").inc()
            return error_response(502, f"upstream replica failed: {type(exc).__name__}: {exc}", "upstream_error")

    async def _send(self, replica: ReplicaLoad, path: str, body: dict[str, Any], stream: bool, request_id: str) -> httpx.Response:
        """POST to one replica; ReplicaUnreachable when no answer came back (nothing was sent
        to the client yet, so the caller may retry elsewhere)."""
        assert self.http is not None
        headers = {"X-Request-Id": request_id}
        try:
            if stream:
                request = self.http.build_request("POST", replica.url + path, json=body, headers=headers)
                return await self.http.send(request, stream=True)
            return await self.http.post(replica.url + path, json=body, headers=headers)
        except CONNECT_ERRORS as exc:
            logger.warning("%s replica %s unreachable: %s", replica.role, replica.replica_id, exc)
            raise ReplicaUnreachable(replica.replica_id, str(exc)) from exc

    async def _prefill(self, path: str, body: dict[str, Any], tokens: int, request_id: str) -> tuple[ReplicaLoad, httpx.Response]:
        """The prefill phase, retried on another prefill replica if one is unreachable."""
        tried: set[str] = set()
        for attempt in range(self.settings.phase_attempts):
            replica = self.policy.choose(list(self.replicas.values()), "prefill", exclude=tried)
            tried.add(replica.replica_id)
            self._enter(replica, tokens)
            started = time.perf_counter()
            try:
                response = await self._send(replica, path, body, stream=False, request_id=request_id)
            except ReplicaUnreachable:
                if attempt + 1 < self.settings.phase_attempts:
                    self.metrics.retries.labels("prefill").inc()
                continue
            finally:
                self._leave(replica, tokens)
            elapsed = time.perf_counter() - started
            self.metrics.prefill.observe(elapsed)
            self.metrics.window(replica.replica_id).phase.add(elapsed)
            return replica, response
        raise ReplicaError(f"no prefill replica could take the request after {len(tried)} attempts")

    def _enter(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests += 1
        replica.inflight_prompt_tokens += tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    def _leave(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests -= 1
        replica.inflight_prompt_tokens -= tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    def _prefill_body(self, body: dict[str, Any], kind: str) -> dict[str, Any]:
        prefill_body = copy.deepcopy(body)
        prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill_body["max_tokens"] = 1
        if kind == "chat":
            prefill_body["max_completion_tokens"] = 1
        for key in ("stream_options", "logprobs", "top_logprobs", "echo"):
            prefill_body.pop(key, None)
        return prefill_body

    async def _disaggregated(self, body: dict[str, Any], kind: str, tokens: int, started: float) -> Response:
        """Prefill, then decode; a decode replica that cannot be reached before it answered is
        excluded and the request is prefilled again for another one (its old lease expires).
        Streaming requests that allow it get the prefill's first token at once and the decode
        replica continues after it (continuation.py)."""
        path = ENDPOINTS[kind]
        prefill_body = self._prefill_body(body, kind)
        continuing = self.settings.first_token_from_prefill and continuation.continuable(body, kind)
        if continuing:
            prefill_body["return_token_ids"] = True
        excluded: set[str] = set()
        for attempt in range(self.settings.phase_attempts):
            request_id = uuid.uuid4().hex
            prefill, p_resp = await self._prefill(path, prefill_body, tokens, request_id)
            if p_resp.status_code != 200:
                self.metrics.requests.labels(kind, "client_error" if p_resp.status_code < 500 else "upstream_error").inc()
                return Response(p_resp.content, status_code=p_resp.status_code, media_type="application/json")
            answer = p_resp.json()
            params = answer.get("kv_transfer_params")
            if not params:
                raise ReplicaError(f"prefill replica {prefill.replica_id} returned no kv_transfer_params")
            if self._faults.random() < self.settings.abandon_after_prefill_rate:
                # Injected fault: the client is gone between phases; nobody pulls this KV.
                self.metrics.requests.labels(kind, "abandoned").inc()
                return error_response(503, "injected fault: request abandoned after prefill", "fault_injection")
            first = continuation.first_token(answer, kind, params) if continuing else None
            self.metrics.first_token_source.labels("prefill" if first is not None else "decode").inc()
            decode = self.policy.choose(list(self.replicas.values()), "decode", exclude=excluded)
            if first is not None:
                continued = continuation.decode_body(body, kind, first, params)
                return self._continue(first, continued, kind, tokens, started, prefill, decode, request_id)
            decode_body = dict(body)
            decode_body["kv_transfer_params"] = params
            explain = functools.partial(self._kv_failure, prefill, decode, request_id)
            try:
                return await self._deliver(
                    decode, path, decode_body, kind, tokens, started, request_id, explain,
                    served_by={"prefill": prefill.replica_id},
                )
            except ReplicaUnreachable:
                excluded.add(decode.replica_id)
                self.metrics.retries.labels("decode").inc()
        raise ReplicaError(f"no decode replica could take the request after {attempt + 1} attempts")

    async def _single(self, body: dict[str, Any], kind: str, tokens: int, started: float) -> Response:
        excluded: set[str] = set()
        for _ in range(self.settings.phase_attempts):
            replica = self.policy.choose(list(self.replicas.values()), "aggregated", exclude=excluded)
            try:
                return await self._deliver(replica, ENDPOINTS[kind], body, kind, tokens, started, uuid.uuid4().hex)
            except ReplicaUnreachable:
                excluded.add(replica.replica_id)
                self.metrics.retries.labels("aggregated").inc()
        raise ReplicaError(f"no replica could take the request after {len(excluded)} attempts")

    async def _kv_failure(self, prefill: ReplicaLoad, decode: ReplicaLoad, request_id: str) -> JSONResponse | None:
        """If the decode replica failed this request because its KV pull failed (failure policy
        `fail`), the OpenAI error that says so; None when that was not the cause."""
        assert self.http is not None
        try:
            answer = await self.http.get(decode.url + "/pdcluster/kv_failure", params={"request_id": request_id}, timeout=5)
            reason = answer.json().get("failure") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        if not reason:
            return None
        return error_response(
            502,
            f"KV handoff from {prefill.replica_id} to {decode.replica_id} failed and "
            f"kv_transfer.failure_policy=fail: {reason}",
            "kv_transfer_error",
        )

    async def _deliver(
        self, replica: ReplicaLoad, path: str, body: dict[str, Any], kind: str, tokens: int, started: float,
        request_id: str, explain: Callable[[], Awaitable[JSONResponse | None]] | None = None,
        served_by: dict[str, str] | None = None,
    ) -> Response:
        """Send the request to the replica that produces the answer and relay it (stream or JSON).

        `served_by` becomes response headers naming the replicas (X-PDCluster-Prefill, ...)."""
        stream = bool(body.get("stream"))
        headers = {f"X-PDCluster-{role.capitalize()}": rid for role, rid in (served_by or {}).items()}
        headers[f"X-PDCluster-{replica.role.capitalize()}"] = replica.replica_id
        self._enter(replica, tokens)
        try:
            upstream = await self._send(replica, path, body, stream, request_id)
        except ReplicaUnreachable:
            self._leave(replica, tokens)
            raise
        if not stream:
            self._leave(replica, tokens)
            self.metrics.e2e.observe(time.perf_counter() - started)
            if upstream.status_code >= 500 and explain is not None and (clear := await explain()) is not None:
                self.metrics.requests.labels(kind, "kv_transfer_error").inc()
                return clear
            outcome = "ok" if upstream.status_code == 200 else ("client_error" if upstream.status_code < 500 else "upstream_error")
            self.metrics.requests.labels(kind, outcome).inc()
            return Response(upstream.content, status_code=upstream.status_code, media_type="application/json", headers=headers)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self._leave(replica, tokens)
            self.metrics.requests.labels(kind, "client_error" if upstream.status_code < 500 else "upstream_error").inc()
            return Response(content, status_code=upstream.status_code, media_type="application/json", headers=headers)
        relay = _Relay(self, upstream, replica, tokens, kind, started)
        return RelayResponse(
            self._stream(upstream, replica, relay, started, explain),
            relay,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **headers},
        )

    def _continue(
        self, first: continuation.FirstToken, body: dict[str, Any], kind: str, tokens: int, started: float,
        prefill: ReplicaLoad, decode: ReplicaLoad, request_id: str,
    ) -> Response:
        """Stream the prefill's first token now; the decode replica's continuation follows.

        The continuation request leaves at once and travels while the client reads the first
        token. A decode replica that cannot be reached before it answered is replaced by another
        one (the prompt's KV stays leased on the producer), up to phase_attempts."""
        relay = _Relay(self, None, None, tokens, kind, started)
        self._dispatch(relay, decode, body, request_id)
        return RelayResponse(
            self._continuation(first, body, prefill, relay, request_id),
            relay,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-PDCluster-Prefill": prefill.replica_id, "X-PDCluster-Decode": decode.replica_id},
        )

    def _dispatch(self, relay: _Relay, decode: ReplicaLoad, body: dict[str, Any], request_id: str) -> None:
        """Send the continuation to `decode` without waiting; the relay owns it from here."""
        self._enter(decode, relay.tokens)
        relay.replica = decode
        relay.pending = asyncio.ensure_future(
            self._send(decode, continuation.CONTINUATION_PATH, body, True, request_id)
        )

    async def _continuation(
        self, first: continuation.FirstToken, body: dict[str, Any], prefill: ReplicaLoad, relay: _Relay, request_id: str,
    ) -> AsyncIterator[bytes]:
        decode = relay.replica
        assert decode is not None and relay.pending is not None
        clock = _TokenClock(self.metrics, decode.replica_id, relay.started)
        tried = {decode.replica_id}
        try:
            prelude = continuation.prelude(first, relay.kind, body)
            for line in prelude:
                clock.see(line)
            yield "".join(line + "\n" for line in prelude).encode()
            while True:
                try:
                    upstream = await relay.pending
                    break
                except httpx.HTTPError as exc:  # reached, then failed (not ReplicaUnreachable)
                    raise ReplicaError(f"decode replica {decode.replica_id} failed: {type(exc).__name__}: {exc}") from exc
                except ReplicaUnreachable as exc:
                    self._leave(decode, relay.tokens)
                    relay.replica = relay.pending = None
                    if len(tried) >= self.settings.phase_attempts:
                        raise ReplicaError(f"no decode replica could continue the request after {len(tried)} attempts") from exc
                    self.metrics.retries.labels("decode").inc()
                    decode = self.policy.choose(list(self.replicas.values()), "decode", exclude=tried)
                    tried.add(decode.replica_id)
                    self._dispatch(relay, decode, body, request_id)
            relay.upstream = upstream
            if upstream.status_code != 200:
                relay.outcome = "client_error" if upstream.status_code < 500 else "upstream_error"
                content = (await upstream.aread()).decode(errors="replace")
                yield f"data: {content}\n\n".encode()
                return
            explain = functools.partial(self._kv_failure, prefill, decode, request_id)
            async for chunk in self._relay_lines(upstream, decode, relay, clock, explain, first):
                yield chunk
        except PDClusterError as exc:
            relay.outcome = "upstream_error"
            error = {"error": {"message": str(exc), "type": exc.error_type, "code": exc.http_status}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            await relay.close()

    async def _stream(
        self, upstream: httpx.Response, replica: ReplicaLoad, relay: _Relay, started: float,
        explain: Callable[[], Awaitable[JSONResponse | None]] | None = None,
    ) -> AsyncIterator[bytes]:
        clock = _TokenClock(self.metrics, replica.replica_id, started)
        try:
            async for chunk in self._relay_lines(upstream, replica, relay, clock, explain):
                yield chunk
        finally:
            await relay.close()

    async def _relay_lines(
        self, upstream: httpx.Response, replica: ReplicaLoad, relay: _Relay, clock: _TokenClock,
        explain: Callable[[], Awaitable[JSONResponse | None]] | None = None,
        first: continuation.FirstToken | None = None,
    ) -> AsyncIterator[bytes]:
        """The replica's SSE lines to the client: a KV failure explained, a continuation
        rewritten as the client's own request (`first`), a broken upstream ended with an error.

        Every complete event of one upstream read leaves in one write: nothing waits for more
        input, and the client is not woken once per line (each write is a syscall here and a
        read there, on the cores the engines use)."""
        events = SSEEvents()
        try:
            async for data in upstream.aiter_bytes():
                if batch := events.feed(data):
                    yield await self._relay_batch(batch, relay, clock, explain, first)
            if batch := events.flush():
                yield await self._relay_batch(batch, relay, clock, explain, first)
        except (httpx.HTTPError, OSError) as exc:
            relay.outcome = "upstream_error"
            logger.error("stream from %s broke: %s", replica.replica_id, exc)
            error = {"error": {"message": f"upstream replica {replica.replica_id} failed mid-stream: {exc}", "type": "upstream_error", "code": 502}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        except asyncio.CancelledError:
            relay.outcome = "cancelled"  # client went away; closing upstream aborts the engine request
            raise

    @staticmethod
    async def _relay_batch(
        batch: list[list[str]], relay: _Relay, clock: _TokenClock,
        explain: Callable[[], Awaitable[JSONResponse | None]] | None,
        first: continuation.FirstToken | None,
    ) -> bytes:
        out: list[str] = []
        for event in batch:
            for line in event:
                if line.startswith('data: {"error"') and explain is not None:
                    relay.outcome = "upstream_error"
                    if (clear := await explain()) is not None:
                        relay.outcome = "kv_transfer_error"
                        line = "data: " + clear.body.decode()
                elif first is not None:
                    line = continuation.rewrite(line, relay.kind, first)
                clock.see(line)
                out.append(line + "\n")
            out.append("\n")
        return "".join(out).encode()


class SSEEvents:
    """Bytes of a server-sent-event stream -> its complete events, each as its lines (an event
    ends at a blank line; a multi-byte character cannot straddle one, so events decode whole)."""

    _END = re.compile(rb"\r?\n\r?\n")

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[list[str]]:
        parts = self._END.split(self._pending + data)
        self._pending = parts.pop()
        return [part.decode(errors="replace").splitlines() for part in parts if part.strip()]

    def flush(self) -> list[list[str]]:
        """What is left once the stream ended (an event without its closing blank line)."""
        rest, self._pending = self._pending, b""
        return [rest.decode(errors="replace").splitlines()] if rest.strip() else []


class _TokenClock:
    """TTFT and inter-token gaps of one relayed stream, as the client sees them."""

    def __init__(self, metrics: RouterMetrics, replica_id: str, started: float):
        self.metrics, self.window, self.started = metrics, metrics.window(replica_id), started
        self.last: float | None = None

    def see(self, line: str) -> None:
        if not (line.startswith("data: ") and _has_token(line)):
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
            self.window.ttft.add(now - self.started)
        else:
            self.metrics.itl.observe(now - self.last)
            self.window.itl.add(now - self.last)
        self.last = now


class _Relay:
    """Cleanup of one relayed stream, run exactly once however the response ends: normally,
    on a broken upstream, on a client disconnect mid-stream, or before the first byte."""

    def __init__(
        self, router: Router, upstream: httpx.Response | None, replica: ReplicaLoad | None,
        tokens: int, kind: str, started: float,
    ):
        self.router, self.upstream, self.replica = router, upstream, replica
        self.tokens, self.kind, self.started = tokens, kind, started
        self.pending: asyncio.Future | None = None  # the upstream request while it is on its way
        self.outcome = "ok"
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.upstream is None and self.pending is not None:
                if not self.pending.done():
                    self.pending.cancel()
                elif not self.pending.cancelled() and self.pending.exception() is None:
                    self.upstream = self.pending.result()
            if self.upstream is not None:
                await self.upstream.aclose()  # closing upstream aborts the engine's request
        finally:
            if self.replica is not None:
                self.router._leave(self.replica, self.tokens)
            self.router.metrics.e2e.observe(time.perf_counter() - self.started)
            self.router.metrics.requests.labels(self.kind, self.outcome).inc()


class _ApiKeyGuard:
    """401 for requests without a valid API key (when keys are configured), /health exempt."""

    def __init__(self, app: Any, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http" and self.router._keys and scope["path"] != "/health"
            and not self.router._authorized(Request(scope))
        ):
            response = error_response(401, "Missing or invalid API key (Authorization: Bearer <key>).", "authentication_error", "invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RelayResponse(StreamingResponse):
    """A streaming response that always runs its relay's cleanup, even when the client is gone
    before the body iterator ever started (an unstarted generator never runs its `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], relay: _Relay, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


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

    def rss_bytes(self) -> int:
        from pdcluster.engine.actor import process_tree_rss

        return process_tree_rss()

    async def stop(self) -> None:
        await self.router.stop()
