"""Shared benchmark plumbing: launch a cluster through the real CLI, stream requests and time
them token by token, summarise, and write results under bench/results/.

Clusters are started with `python -m pdcluster.cli up` on a generated YAML (an isolated
PDCLUSTER_HOME and router port) and stopped with `down`, exactly as a user would.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = ROOT / "models" / "pdcluster-tiny-code"
TEXT_IDS = range(300, 4000)  # the tiny model has 4096 ids; the low ones are bytes and specials


def shipped_config() -> dict:
    """The default cluster's YAML (configs/local-cpu.yaml, what `make run` launches)."""
    return yaml.safe_load((ROOT / "configs" / "local-cpu.yaml").read_text())


def engine_dtype() -> str:
    """The dtype the default cluster's engines run the bench model in on this machine (its
    `model.dtype`, `native` resolved as pdcluster's engines resolve it): for baselines outside
    pdcluster, so that every setup of a run computes in the same dtype."""
    from pdcluster.engine.dtype import resolve_dtype

    return resolve_dtype(shipped_config()["model"]["dtype"], str(MODEL), on_cpu=True)[0]


def base_config(name: str, **overrides) -> dict:
    """The default cluster, named `name`, on the bench model, with every prompt taking the P/D
    path (no local prefill: the path most benchmarks measure) unless `overrides` set it."""
    config = shipped_config()
    config["name"] = name
    config["model"]["path"] = str(MODEL)
    config["router"]["port"] = 0  # any free port, taken as the router binds (the endpoint `up` prints)
    config["router"]["local_prefill_max_tokens"] = 0
    config["router"]["local_prefill_queue_tokens"] = 0
    merge(config, overrides)
    return config


def merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def pdcluster(home: Path, *args: str, timeout: float = 900) -> str:
    env = dict(os.environ, PDCLUSTER_HOME=str(home))
    result = subprocess.run(
        [sys.executable, "-m", "pdcluster.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"pdcluster {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
        )
    return result.stdout


@contextlib.contextmanager
def cluster(config: dict, workdir: Path) -> Iterator[str]:
    """`pdcluster up` a config; yields the endpoint URL; `down` on exit."""
    home = workdir / f"home-{config['name']}"
    home.mkdir(parents=True, exist_ok=True)
    path = home / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    out = pdcluster(home, "up", str(path))
    endpoint = out.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    try:
        yield endpoint
    finally:
        pdcluster(home, "down", "--name", config["name"], timeout=300)


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            samples.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return samples


def status(config: dict, workdir: Path) -> dict:
    home = workdir / f"home-{config['name']}"
    return json.loads(pdcluster(home, "status", "--json", "--name", config["name"]))


@dataclass
class RequestTiming:
    ok: bool
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    itls: list[float] = field(default_factory=list)  # per token, after the first
    error: str = ""


def stream_completion(
    client: httpx.Client, model: str, prompt, max_tokens: int, messages: list | None = None, **extra
) -> RequestTiming:
    """One streaming completion (a chat completion of `messages` when given); per-token
    inter-token latencies from vLLM's continuous usage."""
    body = {
        "model": model,
        **({"messages": messages} if messages is not None else {"prompt": prompt}),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **extra,
    }
    start = time.perf_counter()
    timing = RequestTiming(ok=False)
    last, seen = None, 0
    try:
        path = "/v1/chat/completions" if messages is not None else "/v1/completions"
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return timing
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    timing.error = str(event["error"])[:200]
                    return timing
                usage = event.get("usage") or {}
                count = usage.get("completion_tokens", seen)
                if count > seen and event.get("choices"):
                    now = time.perf_counter()
                    new = count - seen
                    if last is None:
                        timing.ttft = now - start
                        timing.itls.extend([0.0] * (new - 1))  # tokens that came with the first
                    else:
                        timing.itls.extend([(now - last) / new] * new)
                    last, seen = now, count
    except httpx.HTTPError as exc:
        timing.error = repr(exc)
        return timing
    timing.e2e = time.perf_counter() - start
    timing.tokens = seen
    timing.ok = seen > 0
    return timing


def rotated(items: list, turn: int) -> list:
    """`items` starting at index turn % len(items): repeat k of a bench starts every setup in this order."""
    turn %= len(items)
    return items[turn:] + items[:turn]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q * (len(ordered) - 1)))))]


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    ok = [t for t in timings if t.ok]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    itls = [x for t in ok for x in t.itls]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(timings),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if not t.ok})[:5],
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)),
        "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "itl_p50_ms": ms(percentile(itls, 0.5)),
        "itl_p99_ms": ms(percentile(itls, 0.99)),
        "tpot_mean_ms": ms(statistics.mean([(t.e2e - t.ttft) / max(1, t.tokens - 1) for t in ok if t.ttft]))
        if ok
        else None,
        "output_tokens_per_s": tokens / wall_s if wall_s else None,
        "output_tokens": tokens,
        "wall_s": wall_s,
    }


# SLO pairs (TTFT ≤ T ms, largest inter-token gap ≤ S ms) every serving benchmark reports: what a
# user feels is per request (did the first token come in time, did the stream ever stall).
SLOS = ((200, 100), (1000, 50), (1000, 100))
# `vllm bench serve --goodput`: the tool's own per-request SLO (its bounds are TTFT and mean
# time per output token, not the largest gap, so it is reported beside SLOS, not instead).
GOODPUT = {"ttft": 200, "tpot": 50}


HANDOFF_BUDGET = "0.05"  # a bucket bound of metrics.HANDOFF_GAP_BUCKETS: the S = 50 ms stall budget
HANDOFF_OVER = (
    f"handoff_gaps_over_{float(HANDOFF_BUDGET) * 1e3:.0f}ms"  # bench/serve.profile's key for the gaps over it
)


def slo_key(pair: tuple[int, int]) -> str:
    """How attainment() names an SLO pair (T, S) in its result."""
    return f"ttft<={pair[0]}ms,gap<={pair[1]}ms"


def mark_cut_streams(detailed: dict, output_len: int) -> None:
    """Count a stream cut short as failed. vLLM's client marks a request successful once a chunk
    carried a token and reads no later error event (the router's mid-stream failures are such
    events); with --ignore-eos every request of a stream brings `output_len` tokens, so one with
    fewer failed: its error says so, and `failed` / `completed` count it."""
    lens = detailed.get("output_lens") or []
    if not output_len or not lens:
        return
    errors = list(detailed.get("errors") or [""] * len(lens))
    cut = [i for i, n in enumerate(lens) if not errors[i] and n < output_len]
    for i in cut:
        errors[i] = f"the stream ended after {lens[i]} of {output_len} tokens"
    if cut:
        detailed["errors"] = errors
        detailed["failed"] = (detailed.get("failed") or 0) + len(cut)
        detailed["completed"] = detailed.get("completed", len(lens)) - len(cut)


def attainment(detailed: dict) -> dict[str, float]:
    """Per SLO pair, the share of requests meeting both bounds, from `vllm bench serve
    --save-detailed` output (per-request `ttfts` and `itls`, seconds; a failed request has no
    TTFT and meets none)."""
    ttfts, itls = detailed.get("ttfts") or [], detailed.get("itls") or []
    errors = detailed.get("errors") or [""] * len(ttfts)
    out = {}
    for t_ms, s_ms in SLOS:
        met = sum(
            1
            for ttft, gaps, error in zip(ttfts, itls, errors)
            if not error and ttft and ttft * 1e3 <= t_ms and max(gaps, default=0.0) * 1e3 <= s_ms
        )
        out[slo_key((t_ms, s_ms))] = met / len(ttfts) if ttfts else 0.0
    return out


def requests(detailed: dict) -> list[dict]:
    """Per request of `vllm bench serve --save-detailed` output: TTFT, the token 1 -> 2 gap, the
    largest gap and where it fell (index 0: between tokens 1 and 2), ms; its error; and when it
    started and its largest gap ended, s on the clock every client shares (the tool's request
    start is time.perf_counter: CLOCK_MONOTONIC), for bench/stalls.py."""
    ttfts, itls = detailed.get("ttfts") or [], detailed.get("itls") or []
    errors = detailed.get("errors") or [""] * len(ttfts)
    starts = detailed.get("start_times") or [None] * len(ttfts)
    out = []
    for ttft, gaps, error, start in zip(ttfts, itls, errors, starts):
        worst = max(range(len(gaps)), key=gaps.__getitem__, default=None)
        timed = start is not None and ttft and worst is not None
        out.append(
            {
                "ttft_ms": ms(ttft) if ttft else None,
                "gap_1_2_ms": ms(gaps[0]) if gaps else None,
                "max_gap_ms": ms(gaps[worst]) if worst is not None else None,
                "max_gap_at": worst,
                "error": error or "",
                "start_s": None if start is None else round(start, 4),
                "max_gap_end_s": round(start + ttft + sum(gaps[: worst + 1]), 4) if timed else None,
            }
        )
    return out


def misses(per_request: list[dict], pair: tuple[int, int]) -> dict[str, int]:
    """Why requests missed the SLO pair (T, S): failed, TTFT only, a gap only (and how many of
    those had their largest gap between tokens 1 and 2), both."""
    t_ms, s_ms = pair
    out = {"failed": 0, "ttft": 0, "gap": 0, "gap_at_1_2": 0, "both": 0}
    for r in per_request:
        if r["error"] or r["ttft_ms"] is None:
            out["failed"] += 1
            continue
        late, stalled = r["ttft_ms"] > t_ms, (r["max_gap_ms"] or 0.0) > s_ms
        if late and stalled:
            out["both"] += 1
        elif late:
            out["ttft"] += 1
        elif stalled:
            out["gap"] += 1
            out["gap_at_1_2"] += r["max_gap_at"] == 0
    return out


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def write_results(stem: str, payload: dict, markdown: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    date = dt.date.today().isoformat()
    (RESULTS / f"{date}-{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    path = RESULTS / f"{date}-{stem}.md"
    path.write_text(markdown)
    return path


def machine() -> dict:
    """Where a result was measured: the CPU (its model and bfloat16 support decide the dtype
    the engines run the model in, `engine_dtype`), so that rows from different machines are told
    apart."""
    import platform

    flags: set[str] = set()
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass  # not Linux: the model from platform only
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "bf16_isa": sorted(flags & {"amx_bf16", "avx512_bf16"}),
        "engine_dtype": engine_dtype(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def timings_to_dicts(timings: list[RequestTiming]) -> list[dict]:
    return [asdict(t) for t in timings]


def process_role(proc) -> str:
    """A process's role in a setup, from its title/command line (and its parent's for engines)."""
    import psutil

    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if cmd.startswith("VLLM::") or "VLLM::" in cmd:
        try:
            parent = process_role(proc.parent()) if proc.parent() else "?"
        except psutil.Error:
            parent = "?"
        return f"{parent} > {cmd.split()[0]}"
    for needle, label in (
        ("ray::RouterActor", "router"),
        ("ray::PrefillWorker", "prefill actor"),
        ("ray::DecodeWorker", "decode actor"),
        ("ray::EngineActor", "aggregated actor"),
        ("ray::", "ray worker (controller, idle)"),
        ("bench serve", "vllm bench serve (client)"),
        ("vllm_pd_proxy", "vllm-pd proxy"),
    ):
        if needle in cmd:
            return label
    if " serve " in cmd and "vllm_cli" in cmd:
        try:
            core = proc.environ().get("VLLM_CPU_OMP_THREADS_BIND")
        except psutil.Error:
            core = None
        return {"0": "vllm serve prefill", "1": "vllm serve decode"}.get(core, "vllm serve")
    if any(
        k in cmd
        for k in (
            "gcs_server",
            "raylet",
            "dashboard",
            "log_monitor",
            "monitor.py",
            "ray.util.client",
            "ray.scripts",
            "runtime_env",
        )
    ):
        return "ray daemons"
    return "other"


def rss_by_role() -> dict[str, float]:
    """Resident memory per process role on this machine (pdcluster, vLLM and Ray processes)."""
    import psutil

    out: dict[str, float] = {}
    for proc in psutil.process_iter():
        try:
            role = process_role(proc)
            if role not in ("other", "vllm bench serve (client)"):
                out[role] = out.get(role, 0.0) + proc.memory_info().rss
        except psutil.Error:
            continue
    return out
