"""EngineHost: one vLLM AsyncLLM plus vLLM's own OpenAI HTTP app, served in-process.

Shared by every engine we run: the prefill and decode Ray actors, aggregated replicas, and the
standalone launcher (`python -m pdcluster.engine.serve`). The router talks to a host over HTTP
exactly as vLLM's disaggregation proxies talk to `vllm serve`: the prefill call carries
`kv_transfer_params={"do_remote_decode": true}` and `max_tokens=1`, the decode call carries the
params the prefill returned. Every request must carry the engine key (http_auth.py), derived from
the cluster secret. Lifecycle: `start()` (engine up, socket listening, URL known) -> serve ->
`stop()`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from pdcluster import compat
from pdcluster.engine.dead_engine import INFO_PATH, RefuseWhileEngineDead
from pdcluster.engine.dtype import NATIVE, resolve_dtype
from pdcluster.engine.http_auth import RequireEngineKey
from pdcluster.engine.kv_errors import KVErrorAnswers
from pdcluster.engine.kv_events import EVENTS_PATH, KVEventRelay
from pdcluster.engine.lifetime import mark_host
from pdcluster.engine.spec import EngineSpec
from pdcluster.engine.stats import EngineStatsRecorder
from pdcluster.engine.vllm_segments import record_segments, release, remove_left_segments
from pdcluster.errors import ConfigError
from pdcluster.kv_transfer.failures import FAILURE_SOCKET_ENV, FailureInbox
from pdcluster.pidfds import private_dir

logger = logging.getLogger(__name__)

WARM_UP_PROMPT_TOKENS = 4  # under a KV block at vLLM's usual sizes (16 on GPU, 128 on CPU): nothing cached
WARM_UP_TOKENS = 2


def frontend_args(spec: EngineSpec, host: str, port: int):
    """vLLM's OpenAI-server argument namespace, for the frontend parts of the app."""
    return compat.openai_frontend_args(
        [
            "--model",
            spec.model,
            "--served-model-name",
            spec.name,
            "--host",
            host,
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
            "--disable-fastapi-docs",
            # usage.prompt_tokens_details.cached_tokens: the prefix-cache hit of each request
            "--enable-prompt-tokens-details",
        ]
    )


class EngineHost:
    def __init__(self, spec: EngineSpec, secret: str):
        """`secret`: the cluster secret; the engine's HTTP app takes only requests that carry the
        engine key derived from it (never logged, never part of the spec)."""
        from pdcluster.keys import engine_http_token

        self.spec = spec
        self._http_token = engine_http_token(secret)
        self.engine = None
        self.stats = EngineStatsRecorder()
        self.url: str | None = None
        self.started_at: float | None = None
        self.async_scheduling: bool | None = None
        self.async_scheduling_reason = ""
        self.single_process: bool | None = None
        self.single_process_reason = ""
        self.replica_cores: list[int] | None = None  # cpu_bind_scope replica: the whole process's cores
        self._server = None
        self._serve_task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self._failures: FailureInbox | None = None
        self._ipc_dir: str | None = None
        self._segments: Path | None = None  # the record of vLLM's queues (vllm_segments.py)
        self.events: KVEventRelay | None = None  # KV cache events for cache-aware routing (kv_events.py)

    async def start(self) -> str:
        """Start the engine and the HTTP app; returns the base URL once both accept requests.
        A start that fails leaves nothing running (what it had started is stopped)."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> str:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from pdcluster.vllm_plugin import request_amx_permission

        compat.require_tested_vllm()
        request_amx_permission()
        mark_host()  # the engine's processes, spawned below, die with this one (lifetime.py)
        self._bind_replica()  # before any thread or process of the engine starts
        self._ipc_dir = private_ipc_dir()
        remove_left_segments()  # vLLM's queues of killed hosts (vllm_segments.py)
        if self.spec.role == "decode":
            # Why a KV pull failed reaches this process's answers (kv_errors.py); the engine's
            # processes, spawned below, inherit where to send it.
            self._failures = FailureInbox(on_abort=self._abort_soon(asyncio.get_running_loop()))
            os.environ[FAILURE_SOCKET_ENV] = self._failures.path
        kwargs = self.spec.engine_kwargs()
        kwargs["dtype"], warning = resolve_dtype(kwargs["dtype"], self.spec.model, on_cpu=compat.platform_device()[1])
        if warning:  # `native` choosing float32 is what was asked for: said, not warned
            (logger.info if self.spec.dtype == NATIVE else logger.warning)(
                "engine %s: %s", self.spec.engine_id, warning
            )
        if self.spec.kv_events:
            from vllm.config import KVEventsConfig

            self.events = KVEventRelay()
            kwargs["kv_events_config"] = KVEventsConfig(**self.events.config())
        engine_args = AsyncEngineArgs(**kwargs)
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        self._note_async_scheduling(vllm_config)
        self._place_model(vllm_config)
        recorder = self.stats
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[lambda config, index=0: recorder],
        )
        self._segments = record_segments()  # what the next host removes if this one is killed
        if self.events is not None:
            # Read once the engine core started: it may settle another block size than the
            # config asked (an attention backend's, a hybrid model's), which vLLM's client copies
            # back into this config; the router hashes prompts in blocks of this size.
            cache = vllm_config.cache_config
            drop = compat.drops_last_cached_block(vllm_config)
            self.events.start(cache.block_size, str(cache.prefix_caching_hash_algo), drop)
        await self._warm_up()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.spec.http_host, self.spec.http_port))
        sock.listen(512)
        sock.setblocking(False)
        self._sock = sock
        port = sock.getsockname()[1]
        app, vllm_app = await self._build_app(port)
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30, lifespan="on")
        self._server = uvicorn.Server(config)
        compat.attach_server(vllm_app, self._server)  # a dead engine's answer, then the server stops
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self.url = f"http://{self.spec.http_advertise_host or self.spec.http_host}:{port}"
        self.started_at = time.time()
        logger.info("engine %s (%s) serving on %s", self.spec.engine_id, self.spec.role, self.url)
        return self.url

    async def _warm_up(self) -> None:
        """One short request through the engine before it serves. vLLM compiles parts of its
        sampler on first use (torch.compile, inductor on CPU: the ranks of sampled tokens that
        logprobs report): without this, the engine's first request asking for logprobs stalls
        every stream of the engine while it compiles (2-3 s on an idle core, over a minute on a
        busy one; its start-up warm-up covers sampling, not logprobs). The prompt is shorter
        than a KV block, so nothing of it is cached (no prefix-cache entry, no KV event); the
        stats it produced are cleared."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0, logprobs=1, prompt_logprobs=1)
        started = time.perf_counter()
        prompt = {"prompt_token_ids": list(range(1, WARM_UP_PROMPT_TOKENS + 1))}
        async for _ in self.engine.generate(prompt, params, f"pdcluster-warm-up-{self.spec.engine_id}"):
            pass
        self.stats.reset()  # every step of the request was recorded before its last output came
        logger.info("engine %s warmed up in %.1f s", self.spec.engine_id, time.perf_counter() - started)

    def _abort_soon(self, loop: asyncio.AbstractEventLoop):
        """What the failure inbox calls (on its thread) for a request the engine must abort: a
        request admitted ahead of its prefill whose lease never came (kv_transfer/ahead.py)."""

        def abort(request_id: str) -> None:
            if self.engine is not None:
                asyncio.run_coroutine_threadsafe(self.engine.abort(request_id, internal=True), loop)

        return abort

    async def _build_app(self, port: int):
        """(what the server serves, vLLM's FastAPI app inside it)."""
        args = frontend_args(self.spec, self.spec.http_host, port)
        app = vllm_app = await compat.build_openai_app(self.engine, args)

        async def pdcluster_info() -> dict[str, Any]:
            return self.info()

        app.add_api_route(INFO_PATH, pdcluster_info, methods=["GET"])
        if self.events is not None:
            from fastapi.responses import StreamingResponse

            events = self.events

            async def kv_events() -> StreamingResponse:
                return StreamingResponse(events.stream(), media_type="application/x-ndjson")

            app.add_api_route(EVENTS_PATH, kv_events, methods=["GET"])
        if self._failures is not None:
            app = KVErrorAnswers(app, self._failures, self.spec.engine_id)
        app = RefuseWhileEngineDead(app, self.spec.engine_id, self._engine_dead, self._stop_serving)
        return RequireEngineKey(app, self._http_token), vllm_app

    def _engine_dead(self) -> bool:
        return self.engine is not None and self.engine.errored

    def _stop_serving(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    async def serving(self) -> None:
        """Return when the HTTP server has stopped: `stop()`, or because the engine died (the first
        request after that stops it: dead_engine.py, or vLLM's app, compat.attach_server)."""
        if self._serve_task is not None:
            await asyncio.shield(self._serve_task)

    def _note_async_scheduling(self, vllm_config) -> None:
        wanted = self.spec.async_scheduling
        actual = bool(vllm_config.scheduler_config.async_scheduling)
        self.async_scheduling = actual
        if wanted and not actual:
            device_type, is_cpu = compat.platform_device()
            self.async_scheduling_reason = (
                f"turned off by vLLM's {device_type} platform"
                if is_cpu
                else "turned off by vLLM for this configuration"
            )
            logger.warning(
                "engine %s: async scheduling requested but %s",
                self.spec.engine_id,
                self.async_scheduling_reason,
            )

    def _bind_replica(self) -> None:
        """cpu_bind_scope `replica`: this process's every thread, and so every thread and process
        the engine starts, on the engine's cores (cpu_bind.py)."""
        if self.spec.cpu_bind_scope != "replica":
            return
        from pdcluster.engine.cpu_bind import bind_this_process, explicit_cores

        cores = explicit_cores(self.spec.cpu_threads_bind)
        if cores is None:
            raise ConfigError(
                f"engine {self.spec.engine_id}: cpu_bind_scope replica needs one explicit core list "
                f"(cpu_bind), not {self.spec.cpu_threads_bind!r}"
            )
        threads = bind_this_process(cores)
        self.replica_cores = cores
        logger.info("engine %s: the replica's %d threads bound to cores %s", self.spec.engine_id, threads, cores)

    def _place_model(self, vllm_config) -> None:
        """CPU engines run their model in the engine-core process where they can (single_process.py)."""
        if not self.spec.single_process or not compat.platform_device()[1]:
            self.single_process = False
            return
        from pdcluster.engine.cpu_bind import explicit_cores
        from pdcluster.engine.single_process import use_single_process

        reason = use_single_process(vllm_config, explicit_cores(self.spec.cpu_threads_bind))
        self.single_process = reason is None
        if reason:
            self.single_process_reason = reason
            logger.info("engine %s keeps its worker process: %s", self.spec.engine_id, reason)

    def info(self) -> dict[str, Any]:
        snap = self.stats.snapshot().to_dict()
        return {
            "engine_id": self.spec.engine_id,
            "role": self.spec.role,
            "url": self.url,
            "healthy": self.engine is not None and not self.engine.errored,
            "model": self.spec.name,
            "async_scheduling": self.async_scheduling,
            "async_scheduling_reason": self.async_scheduling_reason,
            "single_process": self.single_process,
            "single_process_reason": self.single_process_reason,
            "replica_cores": self.replica_cores,
            "speculative": self.spec.speculative,
            "stats": snap,
        }

    async def stop(self) -> None:
        if self._server is not None:
            if self.events is not None:
                self.events.end_streams()  # the server waits for every open response to end
            self._stop_serving()
            if self._serve_task is not None:
                try:
                    async with asyncio.timeout(10):
                        await self._serve_task
                except asyncio.TimeoutError:
                    logger.warning("HTTP server of %s did not stop in time", self.spec.engine_id)
                    self._serve_task.cancel()
            self._server = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._segments is not None:
            release(self._segments)  # what vLLM's shutdown left (an engine that had died)
            self._segments.unlink(missing_ok=True)
            self._segments = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.events is not None:
            self.events.stop()
            self.events = None
        if self._failures is not None:
            self._failures.close()
            self._failures = None
            os.environ.pop(FAILURE_SOCKET_ENV, None)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)  # sockets of processes now gone
            os.environ.pop(RPC_BASE_ENV, None)
            self._ipc_dir = None


RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"


def private_ipc_dir() -> str | None:
    """A directory of this engine's own (mode 0700) for vLLM's ZMQ sockets between the engine's
    processes, removed when the engine stops. vLLM names them ipc://$VLLM_RPC_BASE_PATH/<uuid>,
    by default in /tmp, and leaves them there whenever a process ends without closing them (a
    test run left thousands). Set before vLLM builds its engine, inherited by the processes it
    spawns; an operator's own VLLM_RPC_BASE_PATH wins (None: nothing made). A temp directory whose
    path leaves no room for a directory of its own and vLLM's socket names in a Unix socket path
    gets vLLM's default (sockets in it, as stock vLLM; a warning says so)."""
    if os.environ.get(RPC_BASE_ENV):
        return None
    try:
        path = private_dir("pdcluster-vllm-ipc-", "vLLM IPC directory", room=36)  # vLLM names sockets by uuid4
    except ConfigError as exc:
        logger.warning("%s; vLLM's IPC sockets go in it directly (as stock vLLM's)", exc)
        return None
    os.environ[RPC_BASE_ENV] = path
    return path
