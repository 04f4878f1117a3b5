"""A decode engine's own answer says why its KV pull failed.

With `kv_transfer.failure_policy: fail`, vLLM finishes a request whose KV load failed with an
error and its OpenAI server answers 500 "Internal server error" (or, streaming, an error event).
This ASGI middleware on the engine's app rewrites exactly that answer for exactly that request:
it reads the request's lease (`remote_request_id` of its kv_transfer_params), and when the
engine's answer is an error it asks the failure inbox (kv_transfer/failures.py) whether that
lease's pull failed; if so the client gets 502 `kv_transfer_error` naming both engines and the
pull's reason. Every other request and answer passes through untouched.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.failures import FailureInbox

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_ERROR_EVENT = re.compile(rb'^data: \{"error".*$', re.M)


def kv_error_body(producer: str, consumer: str, reason: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"KV handoff from {producer} to {consumer} failed and kv_transfer.failure_policy=fail: {reason}",
            "type": "kv_transfer_error",
            "param": None,
            "code": 502,
        }
    }


def lease_of(body: bytes) -> str | None:
    """The producer's request id a decode request carries, or None."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    params = request.get("kv_transfer_params") if isinstance(request, dict) else None
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
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        lease = lease_of(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the client's disconnect, when it comes

        if lease is None:
            await self.app(scope, replay, send)
            return
        await self.app(scope, replay, _Rewriter(send, self, lease))

    def explained(self, lease: str) -> dict[str, Any] | None:
        found = self.inbox.take(lease)
        return None if found is None else kv_error_body(found[0], self.engine_id, found[1])


class _Rewriter:
    """The engine's `send` for one request: errors of a failed pull carry its reason."""

    def __init__(self, send, owner: KVErrorAnswers, lease: str):
        self.send, self.owner, self.lease = send, owner, lease
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
        if self.streaming and b'data: {"error"' in message.get("body", b""):
            message = dict(message, body=_ERROR_EVENT.sub(self._event, message["body"]))
        await self.send(message)

    def _event(self, match: re.Match) -> bytes:
        explained = self.owner.explained(self.lease)
        return match.group(0) if explained is None else b"data: " + json.dumps(explained).encode()

    async def _send_held(self) -> None:
        start, body = self.held, b"".join(self.held_body)
        self.held = None
        explained = self.owner.explained(self.lease)
        if explained is not None:
            body = json.dumps(explained).encode()
            start = {
                "type": "http.response.start",
                "status": 502,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
