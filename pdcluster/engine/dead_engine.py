"""An engine host whose engine died ends its answers as a dead replica's would, then stops.

vLLM's engine core can die under a live host (a crash, an OOM kill): the host's process, its HTTP
server and its replica's actor live on. Left to vLLM, a request in flight would end with vLLM's
error (an error event in a stream, a 500), and a request arriving after the death would be handed
to the dead engine and answered 500: the router would relay each as the client's answer. Here the
router sees what a replica that died would show it (router/upstream.py, handoff.py):
  - a request arriving once the engine is known dead is answered 503 before vLLM sees it (nothing
    of it started): the router sends it to another replica of the role (a decode keeps the
    request's KV lease for another), as one it never reached;
  - an answer vLLM was writing is cut (its connection closed mid-answer, vLLM's error not sent):
    the router recovers the request as from a replica that died mid-answer (a stream goes on on
    another decode replica from the tokens already sent; a prefill is asked again elsewhere).
The server then stops, as vLLM's does when its engine dies. The engine's info (`/pdcluster/info`)
is still answered (`healthy: false`); the controller replaces the replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdcluster.engine.http_auth import error_body, send_error

INFO_PATH = "/pdcluster/info"

logger = logging.getLogger(__name__)


class EngineDiedMidAnswer(Exception):
    """Raised into vLLM's app from `send`: uvicorn then closes the connection mid-answer."""


class _QuietCuts(logging.Filter):
    """uvicorn logs each cut answer as an application error with its traceback; the cut is ours
    and logged once per answer as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], EngineDiedMidAnswer))


class RefuseWhileEngineDead:
    def __init__(self, app: Any, engine_id: str, dead: Callable[[], bool], stop: Callable[[], None]):
        self.app = app
        self.engine_id = engine_id
        self._dead = dead  # whether the engine died (vLLM's AsyncLLM.errored)
        self._stop = stop  # stop serving: the answer still goes out
        uvicorn_errors = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _QuietCuts) for f in uvicorn_errors.filters):
            uvicorn_errors.addFilter(_QuietCuts())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") == INFO_PATH:
            await self.app(scope, receive, send)
            return
        if not self._dead():
            await self.app(scope, receive, self._cut_if_dead(send))
            return
        self._stop()
        message = f"the engine of {self.engine_id} died: nothing of this request was started here"
        await send_error(send, 503, error_body(message, "engine_dead", 503))

    def _cut_if_dead(self, send):
        """`send` for an answer vLLM writes: once the engine is dead, none of its body goes out
        (an error event, a 500's body, tokens past the death): the connection is cut instead."""

        async def guarded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and self._dead():
                self._stop()
                logger.warning("engine %s died: an answer it was writing is cut", self.engine_id)
                raise EngineDiedMidAnswer(f"the engine of {self.engine_id} died: answer cut")
            await send(message)

        return guarded
