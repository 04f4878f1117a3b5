"""Engines' HTTP apps answer only the cluster: every request must carry the engine key.

An engine's own OpenAI app (vLLM's) is an internal port: only the router (and the controller's
tools) may use it. A client reaching it directly would bypass the router's API keys and could
hand decode `kv_transfer_params` of its own. This ASGI middleware, outermost on every engine's
app, answers 401 (OpenAI-style JSON) to any HTTP request whose `Authorization: Bearer` is not the
engine key, which is derived from the cluster secret (keys.engine_http_token), on every path:
vLLM's own `--api-key` guards only /v1. WebSocket handshakes are closed the same way.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from pdcluster.errors import openai_error


def error_body(message: str, kind: str, code: int) -> bytes:
    """An OpenAI-style error answer."""
    return json.dumps(openai_error(message, kind, code)).encode()


def unauthorized_body() -> bytes:
    return error_body(
        "engine ports take only the cluster's requests: missing or wrong engine key", "authentication_error", 401
    )


async def send_error(send, code: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    """Answer an ASGI HTTP request with `body` (error_body) and status `code`."""
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequireEngineKey:
    def __init__(self, app: Any, token: str):
        if not token:
            raise ValueError("an engine's HTTP app needs its engine key")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, scope) -> bool:
        presented = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                presented = value
        return hmac.compare_digest(presented, self._expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(send, 401, unauthorized_body(), (b"www-authenticate", b"Bearer"))
