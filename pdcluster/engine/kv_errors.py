"""A decode engine's own answer says why its KV pull failed.

With `kv_transfer.failure_policy: fail`, vLLM finishes a request whose KV load failed with an
error and its OpenAI server answers 500 "Internal server error" (or, streaming, an error event).
This ASGI middleware on the engine's app rewrites exactly that answer for exactly that request:
when the engine's answer is an error it reads the request's lease (`remote_request_id` of its
kv_transfer_params) and asks the failure inbox (kv_transfer/failures.py) whether that lease's
pull failed; if so the client gets 502 `kv_transfer_error` naming both engines and the
pull's reason. A request admitted ahead of its prefill whose lease never came is aborted
(whatever the policy, kv_transfer/ahead.py): its aborted stream, which vLLM ends with no event,
gets that error before its end, found by its lease key. Every other request and answer passes through untouched.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdcluster.engine.http_auth import send_error
from pdcluster.errors import openai_error
from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.failures import FailureInbox

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_ERROR_EVENT = re.compile(rb'^data: \{"error".*$', re.M)
_DONE = b"data: [DONE]"


def kv_error_body(producer: str, consumer: str, reason: str, aborted: bool = False) -> dict[str, Any]:
    """`aborted`: a request admitted ahead of its prefill whose lease never came (any policy)."""
    why = "no lease came for a request admitted ahead of its prefill" if aborted else "kv_transfer.failure_policy=fail"
    return openai_error(
        f"KV handoff from {producer} to {consumer} failed and {why}: {reason}", "kv_transfer_error", 502
    )


def lease_of(body: bytes) -> str | None:
    """What a decode request's failed pull is reported under: the producer's request id of its
    lease, or the key of one admitted ahead of its prefill; None for other requests."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    params = request.get("kv_transfer_params") if isinstance(request, dict) else None
    if kvp.wants_lease_await(params):
        spec = params.get(kvp.AWAIT)
        key = spec.get("key") if isinstance(spec, dict) else None
        return key if isinstance(key, str) else None
    if not kvp.wants_remote_prefill(params):
        return None
    lease = params.get("remote_request_id")
    return lease if isinstance(lease, str) else None


class KVErrorAnswers:
    def __init__(self, app: Any, inbox: FailureInbox, engine_id: str):
        self.app, self.inbox, self.engine_id = app, inbox, engine_id

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def keep():
            message = await receive()  # the app reads the body anyway: keep a reference to it
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        await self.app(scope, keep, _Rewriter(send, self, chunks))

    def explained(self, body_chunks: list[bytes]) -> dict[str, Any] | None:
        """The error for a request whose answer is an error: its pull's failure, if it had one
        (the request's body is parsed only here, on an error)."""
        lease = lease_of(b"".join(body_chunks))
        found = None if lease is None else self.inbox.take(lease)
        return None if found is None else kv_error_body(found[0], self.engine_id, found[1], aborted=found[2])


class _Rewriter:
    """The engine's `send` for one request: errors of a failed pull carry its reason."""

    def __init__(self, send, owner: KVErrorAnswers, body_chunks: list[bytes]):
        self.send, self.owner, self.body_chunks = send, owner, body_chunks
        self.held: dict[str, Any] | None = None  # the start of a 5xx answer, until its body is known
        self.held_body: list[bytes] = []
        self.streaming = False

    async def __call__(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers") or [])
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if message["status"] >= 500 and not self.streaming:
                self.held = message
                return
            await self.send(message)
            return
        if kind != "http.response.body":
            await self.send(message)
            return
        if self.held is not None:
            self.held_body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send_held()
            return
        body = message.get("body", b"")
        if self.streaming and b'data: {"error"' in body:
            message = dict(message, body=_ERROR_EVENT.sub(self._event, body))
        elif self.streaming and _DONE in body and (explained := self.owner.explained(self.body_chunks)):
            # aborted without an error event of vLLM's (a request whose lease never came)
            event = b"data: " + json.dumps(explained).encode() + b"\n\n"
            message = dict(message, body=body.replace(_DONE, event + _DONE, 1))
        await self.send(message)

    def _event(self, match: re.Match) -> bytes:
        explained = self.owner.explained(self.body_chunks)
        return match.group(0) if explained is None else b"data: " + json.dumps(explained).encode()

    async def _send_held(self) -> None:
        start, body = self.held, b"".join(self.held_body)
        self.held = None
        explained = self.owner.explained(self.body_chunks)
        if explained is not None:
            await send_error(self.send, 502, json.dumps(explained).encode())
            return
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
