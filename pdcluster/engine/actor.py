"""EngineActor: the Ray actor body every replica shares (prefill, decode, aggregated).

One actor process hosts one EngineHost (AsyncLLM + vLLM's OpenAI app on an internal port). The
controller creates it with the engine's environment (runtime_env), calls `start()` and awaits it
(readiness is that call returning), polls `info()` for status/health, and calls `shutdown()`
before killing it so the engine's own processes exit too. Role-specific actors
(prefill_worker/, decode_worker/) subclass this and only add what their role needs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pdcluster.addresses import binds_every_address, node_ip
from pdcluster.engine.spec import EngineSpec
from pdcluster.logs import setup_logging
from pdcluster.pidfds import maker_tag, remove_left_behind

logger = logging.getLogger(__name__)


def process_tree_rss() -> int:
    """Resident memory of this process and its children (the engine's own processes)."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue  # exited meanwhile
    return total


SECRET_FILE_PREFIX = "pdcluster-secret-"
SECRET_FILE_SUFFIX = ".secret"


def write_secret_file(engine_id: str, secret: str, directory: str | None = None) -> str:
    """A private file (0600) holding the KV secret, for the engine's processes to read as they
    start; removed once they run (EngineActor.start). Named after the process writing it and its
    engine (`<cluster>-<replica>`): `pdcluster-secret-<pid namespace>.<pid>-<engine>.<random>.secret`.
    An actor killed in the middle of a start leaves its file behind: such files, whose writer is
    gone, are removed here first, by the next engine started on the node (pidfds.remove_left_behind:
    only files written in this pid namespace)."""
    directory = directory or tempfile.gettempdir()
    remove_left_behind(directory, SECRET_FILE_PREFIX, "KV secret file", valid=lambda n: n.endswith(SECRET_FILE_SUFFIX))
    fd, path = tempfile.mkstemp(
        prefix=f"{SECRET_FILE_PREFIX}{maker_tag()}-{engine_id}.", suffix=SECRET_FILE_SUFFIX, dir=directory
    )
    with os.fdopen(fd, "w") as f:  # mkstemp: readable by its owner only
        f.write(secret)
    return path


class EngineActor:
    role = "aggregated"

    def __init__(self, spec: EngineSpec, secret: str):
        setup_logging()
        if spec.role != self.role:
            raise ValueError(f"{type(self).__name__} runs {self.role} engines, not {spec.role}")
        if not secret:
            raise ValueError("an engine needs the cluster secret (its HTTP key and KV keys derive from it)")
        self._secret = secret
        self._secret_path: str | None = None
        if spec.kv_extra is not None:
            spec.kv_extra = self._node_kv_settings(dict(spec.kv_extra), secret, spec.engine_id)
        if binds_every_address(spec.http_host):
            spec.http_advertise_host = node_ip()
        self.spec = spec
        self.host = None
        self.stage = "created"
        self.error: str | None = None
        self._start_lock = asyncio.Lock()

    def _node_kv_settings(self, kv: dict[str, Any], secret: str, engine_id: str) -> dict[str, Any]:
        """Node-local parts of the KV settings (KVTransferSettings fields): the secret file, the
        address peers dial."""
        self._secret_path = kv["secret_file"] = write_secret_file(engine_id, secret)
        if binds_every_address(kv.get("bind_host", "127.0.0.1")) and not kv.get("advertise_host"):
            kv["advertise_host"] = node_ip()
        return kv

    async def start(self) -> dict[str, Any]:
        """Start the engine; returns info() once it serves. Idempotent once it served; an actor
        whose start failed is spent (its secret file is gone): the controller starts a new one."""
        from pdcluster.engine.host import EngineHost

        async with self._start_lock:
            if self.host is not None and self.host.url is not None:
                return self.info()
            self.stage = "starting engine"
            try:
                self.host = EngineHost(self.spec, self._secret)
                await self.host.start()
            except Exception as exc:
                self.stage = "failed"
                self.error = f"{type(exc).__name__}: {exc}"
                logger.exception("engine %s failed to start", self.spec.engine_id)
                raise
            finally:
                # Every process of the engine read the secret while it started: a file left
                # behind would outlive an actor that is killed.
                self._remove_secret_file()
            self.stage = "ready"
            return self.info()

    def info(self) -> dict[str, Any]:
        base = {
            "engine_id": self.spec.engine_id,
            "role": self.spec.role,
            "node": node_ip(),
            "pid": os.getpid(),
            "stage": self.stage,
            "error": self.error,
            "rss_bytes": process_tree_rss(),
        }
        if self.host is not None:
            base.update(self.host.info())
        return base

    async def shutdown(self) -> None:
        self.stage = "stopping"
        if self.host is not None:
            await self.host.stop()
            self.host = None
        self._remove_secret_file()
        self.stage = "stopped"

    def _remove_secret_file(self) -> None:
        if self._secret_path is not None:
            Path(self._secret_path).unlink(missing_ok=True)
            self._secret_path = None
