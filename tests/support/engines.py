"""Start real vLLM engines (pdcluster.engine.serve) in separate processes for tests.

Readiness is the engine's own "ready" line on stdout (never a sleep); a process that exits or
stays silent past the deadline fails the test with its stderr tail. Engines take only requests
carrying the engine key derived from the secret they were started with (`RunningEngine.headers`,
and `client()` sends them).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from pdcluster.engine.spec import EngineSpec
from pdcluster.keys import engine_http_token
from pdcluster.kv_transfer.settings import KVTransferSettings

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "pdcluster-tiny-code"
# Engines started together share the 2 cores (an engine start is ~25 CPU-s, mostly imports) with
# the other test lane: the deadline grows with how many start at once (7 at once missed a flat 240 s).
STARTUP_TIMEOUT_S = 240
STARTUP_EXTRA_PER_ENGINE_S = 60
MAX_MODEL_LEN = 1024  # the context of every test engine (tiny_engine)
# KV cache of every test engine: ~50k float32 tokens of the tiny model, 40 full contexts (the
# whole GiB a cluster role gets would hold 200k and cost every engine 0.75 GiB more memory).
KV_CACHE_BYTES = 256 << 20
TEST_SECRET = "engines-test-secret-5b1e"  # of engines that are given no secret file


@dataclass
class RunningEngine:
    spec: EngineSpec
    url: str
    process: subprocess.Popen
    log_path: Path
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        """What the router sends: the engine key (pdcluster/engine/http_auth.py)."""
        return {"Authorization": f"Bearer {engine_http_token(self.secret)}"}

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def _wait_ready(proc: subprocess.Popen, log_path: Path, deadline: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buffered = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            state = "exited" if proc.poll() is not None else "timed out"
            raise RuntimeError(f"engine {state} before ready:\n{tail}")
        if not sel.select(timeout=min(remaining, 1.0)):
            continue
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            continue
        buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "ready":
                return event["url"]


def secret_file_of(spec: EngineSpec, log_dir: Path) -> Path:
    """The cluster secret an engine starts with: its KV settings' file, else a test secret."""
    if spec.kv_extra and spec.kv_extra.get("secret_file"):
        return Path(spec.kv_extra["secret_file"])
    path = log_dir / "engine.secret"
    if not path.exists():
        path.write_text(TEST_SECRET)
        path.chmod(0o600)
    return path


def _launch(spec: EngineSpec, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log_path = log_dir / f"{spec.engine_id}.log"
    env = dict(os.environ)
    env.update(spec.env())
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdcluster.engine.serve",
                "--spec-json",
                spec.to_json(),
                "--secret-file",
                str(secret_file_of(spec, log_dir)),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=REPO,
            # A process group of its own (stop_processes ends it whole), in the test session's
            # session: where the kernel's session autogrouping stays on (tools/autogroup.py), a
            # session per engine made each engine a scheduling group of its own.
            process_group=0,
        )
    return proc, log_path


@contextlib.contextmanager
def run_engines(specs: list[EngineSpec], log_dir: Path) -> Iterator[dict[str, RunningEngine]]:
    """Start all engines at once (they load concurrently), then await each one's ready line."""
    launched = [(spec, *_launch(spec, log_dir)) for spec in specs]
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S + STARTUP_EXTRA_PER_ENGINE_S * (len(specs) - 1)
        running = {}
        for spec, proc, log_path in launched:
            url = _wait_ready(proc, log_path, deadline)
            secret = secret_file_of(spec, log_dir).read_text().strip()
            running[spec.engine_id] = RunningEngine(spec, url, proc, log_path, secret)
        yield running
    finally:
        stop_processes([proc for _, proc, _ in launched])


@contextlib.contextmanager
def run_engine(spec: EngineSpec, log_dir: Path) -> Iterator[RunningEngine]:
    with run_engines([spec], log_dir) as running:
        yield running[spec.engine_id]


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM every engine at once (each takes seconds to shut its engine core down), then wait
    for each; one still running at the deadline loses its whole process group."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def tiny_engine(
    engine_id: str,
    role: str = "aggregated",
    *,
    dtype: str = "auto",
    secret_file: Path | None = None,
    kv: dict | None = None,
    engine_args: dict | None = None,
    **fields,
) -> EngineSpec:
    """An engine of the shipped tiny model as the tests run it: served as "tiny", 1024 tokens of
    context, eager, KV_CACHE_BYTES of KV cache; a prefill or decode engine gets `kv_extra(secret_file,
    **kv)`. Other EngineSpec fields (speculative, cpu_threads_bind, single_process, ...) as given."""
    return EngineSpec(
        role=role,
        engine_id=engine_id,
        model=str(MODEL),
        served_model_name="tiny",
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        engine_args={"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES, **(engine_args or {})},
        kv_extra=None if role == "aggregated" else kv_extra(secret_file, **(kv or {})),
        **fields,
    )


def kv_extra(secret_file: Path, **overrides) -> dict:
    """An engine's KV connector config: KVTransferSettings (validated) with test defaults (grpc,
    any free port) and `overrides` by field name."""
    fields = {"backend": "grpc", "port_range": (0, 0), "lease_seconds": 30, "pull_timeout_seconds": 20}
    fields.update(overrides)
    return KVTransferSettings(**fields).connector_config(str(secret_file))


ENGINE_PATHS = (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/pdcluster/info"), ("GET", "/metrics"))


def assert_engine_key_required(url: str, headers: dict[str, str]) -> None:
    """Every path of an engine's HTTP app answers 401 (OpenAI-style) without the engine key or
    with a wrong one, and serves the right one."""
    right = headers["Authorization"]
    for method, path in (*ENGINE_PATHS, ("GET", "/health")):
        for presented in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": right + "0"}):
            response = httpx.request(method, url + path, headers=presented, json={"model": "tiny"}, timeout=30)
            assert response.status_code == 401, (method, path, presented, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
    for method, path in ENGINE_PATHS[1:]:
        assert httpx.request(method, url + path, headers=headers, timeout=30).status_code == 200, path


def engine_core(pid: int) -> psutil.Process:
    """The one vLLM engine-core process (VLLM::EngineCore) below process `pid`."""
    (core,) = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    return core


def vllm_processes(pid: int) -> dict[str, list[int]]:
    """The engine's vLLM processes by title (VLLM::EngineCore, VLLM::Worker...): the cores each
    one's main thread may run on."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        if child.name().startswith("VLLM::"):
            found[child.name()] = child.cpu_affinity()
    return found


def thread_cores(pid: int) -> set[tuple[int, ...]]:
    """The core sets the threads of process `pid` and of every process below it may run on."""
    found = set()
    root = psutil.Process(pid)
    for proc in (root, *root.children(recursive=True)):
        for thread in proc.threads():
            try:
                found.add(tuple(sorted(os.sched_getaffinity(thread.id))))
            except ProcessLookupError:
                continue  # the thread ended meanwhile
    return found
