"""An engine host whose engine died answers 503 without starting anything, then stops serving.

vLLM's engine core can die under a live host (a crash, an OOM kill): the host's process, its HTTP
server and its replica's actor live on. vLLM's app would hand a request to the dead engine, answer
500 and stop the server (compat.attach_server). A request that arrives once the engine is known
dead is answered here instead, before vLLM sees it: 503, which says that nothing of it was started,
so the router sends it to another replica (a decode keeps the request's KV lease for another;
router/upstream.py); the server then stops as vLLM's would. A request vLLM had taken (in flight
when the engine died, or in the instant before vLLM saw the death) gets vLLM's 500 and is not
retried: it may be what killed the engine. The engine's info
(`/pdcluster/info`) is still answered (`healthy: false`); the controller replaces the replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcluster.engine.http_auth import error_body, send_error

INFO_PATH = "/pdcluster/info"


class RefuseWhileEngineDead:
    def __init__(self, app: Any, engine_id: str, dead: Callable[[], bool], stop: Callable[[], None]):
        self.app = app
        self.engine_id = engine_id
        self._dead = dead  # whether the engine died (vLLM's AsyncLLM.errored)
        self._stop = stop  # stop serving: the answer still goes out

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") == INFO_PATH or not self._dead():
            await self.app(scope, receive, send)
            return
        self._stop()
        message = f"the engine of {self.engine_id} died: nothing of this request was started here"
        await send_error(send, 503, error_body(message, "engine_dead", 503))
