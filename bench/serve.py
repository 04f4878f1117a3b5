"""Serving benchmark: pdcluster P/D vs pdcluster aggregated vs vLLM's own P/D, same cores.

Setups, started in turn on the same 2 cores with the same model and engine settings:
  pd          pdcluster, 1 prefill (core 0) + 1 decode (core 1), KV over our connector (backend
              `auto`: shared memory, both on one node); streams get the prefill's first token at
              once (router.first_token_from_prefill); prompts of at most 256 tokens go to decode
              alone (router.local_prefill_max_tokens), and prompts of at most 512 that would queue
              behind 512 on prefill (router.local_prefill_queue_tokens): the default cluster's
              router settings
  aggregated  pdcluster `mode: aggregated`, 2 replicas (core 0, core 1), no handoff
  vllm-pd     two stock `vllm serve` engines with vLLM's NixlConnector (prefill core 0, decode
              core 1) behind a minimal proxy doing the do_remote_decode -> kv_transfer_params
              handoff (bench/vllm_pd_proxy.py)
  pd-classic  `pd` with first_token_from_prefill off: decode samples the first token (diagnostic)
pdcluster's engines run their model in the engine-core process (roles.*.single_process, the
default), and each replica's every thread, vLLM's front end included, runs on its core
(roles.*.cpu_bind_scope replica, as the default cluster since run 30); `vllm serve` keeps vLLM's
CPU layout (a worker process per engine).

The vllm-pd baseline is stock vLLM (pdcluster's plugin not loaded, stock knobs only); what that
means on CPU and the two things it still needs from us to run at all (the CPU wheel's CLI
version lookup; AMX permission on AMX CPUs) are in bench/vllm_pd_proxy.py.

Workloads, driven by vLLM's own client (`vllm bench serve`, random dataset), so the numbers are
computed by a tool we did not write:
  steady        short prompts at a steady Poisson rate
  interference  decode-heavy streams, while long prompts (>= 1.5k tokens) arrive concurrently
                (two `vllm bench serve` runs at once; ITL is read from the decode-heavy one)
  interference-3k  the same with 3072-token long prompts (diagnostic): one long prefill outlasts
                S = 100 ms on every machine we ran, where a 1536-token one may not (~100 ms here)
  steady-2k     steady's prefill load as 2048-token prompts at 1 req/s (diagnostic): the same
                handoff cost against a prefill ~4x as long
  light         the steady prompts at 0.5 req/s (diagnostic): TTFT without a queue
The engines' own vLLM timings (TTFT at the front end, queue, scheduled steps) are read from their
authenticated /metrics with a secret of the bench's own; the sweep takes TTFT apart with them.
Writes bench/results/<date>-serve.{md,json} and TTFT/ITL CDF plots (PNG): bench/serve_report.py.

Usage: python bench/serve.py [--setups pd aggregated vllm-pd pd-classic] [--workloads steady interference light] [--quick]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    GOODPUT,
    MODEL,
    ROOT,
    base_config,
    cluster,
    mark_cut_streams,
    shipped_config,
    status,
)
from bench.serve_profile import ENGINES, cpu_profile, cpu_snapshot, profile, scrape  # noqa: E402
from bench.serve_report import report, summarize  # noqa: E402
from bench.vllm_pd_proxy import vllm_pd_setup  # noqa: E402
from pdcluster.config import RoleSection  # noqa: E402
from pdcluster.keys import engine_http_token  # noqa: E402
from tools import autogroup  # noqa: E402

ENGINE_ARGS = {"enforce_eager": True, "max_num_seqs": 64, "max_num_batched_tokens": 4096}
MAX_MODEL_LEN = 4096
KV_GIB = 2


@contextlib.contextmanager
def pdcluster_setup(
    name: str,
    mode: str,
    workdir: Path,
    first_token_from_prefill: bool = True,
    policy: str | None = None,
    router: dict | None = None,
    kv_transfer: dict | None = None,
    *,
    cpu_bind_scope: str,
) -> Iterator[str]:
    roles = {
        "prefill": {
            "replicas": 1 if mode == "disaggregated" else 0,
            "cpu_bind": ["0"],
            "cpu_bind_scope": cpu_bind_scope,
            "kv_cache_gib": KV_GIB,
            "engine_args": ENGINE_ARGS,
        },
        "decode": {
            "replicas": 1 if mode == "disaggregated" else 0,
            "cpu_bind": ["1"],
            "cpu_bind_scope": cpu_bind_scope,
            "kv_cache_gib": KV_GIB,
            "engine_args": ENGINE_ARGS,
        },
        "aggregated": {
            "replicas": 2 if mode == "aggregated" else 0,
            "cpu_bind": ["0", "1"],
            "cpu_bind_scope": cpu_bind_scope,
            "kv_cache_gib": KV_GIB,
            "engine_args": ENGINE_ARGS,
        },
    }
    # A secret of the bench's own, so that it can read the engines' vLLM metrics (serve_profile.engine_samples).
    secret = secrets.token_hex(32)
    secret_file = workdir / f"{name}.secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secret)
    config = base_config(
        name,
        mode=mode,
        roles=roles,
        speculative=None,
        model={"max_model_len": MAX_MODEL_LEN},
        router={
            "first_token_from_prefill": first_token_from_prefill,
            **({"policy": policy} if policy else {}),
            **(router or {}),
        },
        kv_transfer={**(kv_transfer or {}), "secret_file": str(secret_file)},
    )
    with cluster(config, workdir) as endpoint:
        replicas = status(config, workdir)["replicas"]
        ENGINES[endpoint] = (engine_http_token(secret), [(r["role"], r["url"]) for r in replicas if r["url"]])
        try:
            yield endpoint
        finally:
            ENGINES.pop(endpoint, None)


def random_dataset(input_len: int, output_len: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len)]


def bench_serve(
    endpoint: str,
    out: Path,
    *,
    prompts: int,
    rate: float,
    seed: int,
    input_len: int = 0,
    output_len: int = 0,
    dataset: list[str] | None = None,
) -> subprocess.Popen:
    """`vllm bench serve` against `endpoint`: the random dataset of `input_len`/`output_len`
    unless `dataset` gives other dataset arguments."""
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "serve_client.py"),
        "--watch-log",
        str(out.with_suffix(".watch.json")),
        *(["--freeze-heap"] if LOAD_GENERATOR["freeze_heap"] else []),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        endpoint,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(MODEL),
        *(dataset or random_dataset(input_len, output_len)),
        "--num-prompts",
        str(prompts),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--goodput",
        *(f"{metric}:{bound}" for metric, bound in GOODPUT.items()),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--disable-tqdm",
    ]
    return start_generator(cmd, open(out.with_suffix(".log"), "wb"))


def start_generator(cmd: list[str], log: IO[bytes]) -> subprocess.Popen:
    """The load generator `cmd`, output to `log`, at LOAD_GENERATOR's priority."""
    nice = LOAD_GENERATOR["nice"]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=bool(nice),
        preexec_fn=(lambda: generator_priority(nice)) if nice else None,
    )


# The load generator stands in for clients on other machines, but shares the 2 cores here.
# nice (--client-nice): while the prefill engine holds one core, a generator at the default
# priority reads its streams late and records stalls the engines and the router did not have
# (bench/results/2026-12-02-serve-sweep-run5.md); negative values need root. freeze_heap
# (--client-freeze-heap): its own full garbage collections stop pausing its reading
# (bench/serve_client.py).
LOAD_GENERATOR = {"nice": 0, "freeze_heap": False}


def generator_priority(nice: int) -> None:
    """The load generator's priority, set in its process before it runs (it has a session of
    its own by then). With the kernel's autogroups on (kernel.sched_autogroup_enabled), CPU time
    is shared between sessions first and nice counts only within one: a generator at nice -10 in
    the benchmark's session still waited runnable up to 2.2 s for a CPU while the cluster's
    session (engines, router, Ray) ran, and recorded those waits as the servers' gaps
    (bench/results/2026-12-03-serve-sweep-probe-autogroup.md). So its own session's autogroup gets
    the same nice."""
    os.nice(nice)
    own_group = Path("/proc/self/autogroup")  # not the module: this session's group
    if own_group.exists():
        own_group.write_text(str(nice))


def autogroups_off() -> None:
    """--no-autogroups: the kernel's scheduler autogroups off while the benchmark runs, as they
    were at its exit (tools/autogroup.py: why a load generator needs it)."""
    try:
        was = autogroup.turn_off()
    except PermissionError:
        raise SystemExit(f"--no-autogroups: writing {autogroup.SWITCH} needs root") from None
    if was is not None:
        atexit.register(autogroup.restore, was)


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client-nice", type=int, default=0, help="nice value of the load generator (e.g. -10: read streams on time)"
    )
    parser.add_argument(
        "--client-freeze-heap",
        action="store_true",
        help="freeze the load generator's startup heap (its full GC pauses are recorded either way)",
    )
    parser.add_argument(
        "--no-autogroups",
        action="store_true",
        help="turn the kernel's scheduler autogroups off for the run (root; restored at exit): "
        "with them on, --client-nice counts only within the generator's own session",
    )


def client_settings(args: argparse.Namespace) -> None:
    LOAD_GENERATOR.update(nice=args.client_nice, freeze_heap=args.client_freeze_heap)
    if args.no_autogroups:
        autogroups_off()


def run_workload(endpoint: str, workload: dict, workdir: Path, tag: str) -> dict:
    """Run each stream of a workload concurrently; return vllm bench serve's results per stream."""
    procs = {}
    for stream, params in workload["streams"].items():
        out = workdir / f"{tag}-{stream}.json"
        procs[stream] = (bench_serve(endpoint, out, **params), out)
    results = {}
    for stream, (proc, out) in procs.items():
        if proc.wait(3600) != 0:
            raise RuntimeError(
                f"vllm bench serve failed ({tag}/{stream}): {out.with_suffix('.log').read_text()[-3000:]}"
            )
        results[stream] = json.loads(out.read_text())
        mark_cut_streams(results[stream], workload["streams"][stream].get("output_len", 0))
        watch = out.with_suffix(".watch.json")  # the client's GC pauses and its own stalls (serve_client.py)
        results[stream]["client_watch"] = json.loads(watch.read_text()) if watch.exists() else None
    return results


WARM_UP_SEED = 1000  # added to each stream's seed: the warm-up's prompts share no prefix with the measured ones


def quarter(workload: dict) -> dict:
    """The workload with a quarter of each stream's requests (at least 4), at the same rates."""
    out = json.loads(json.dumps(workload))
    for stream in out["streams"].values():
        stream["prompts"] = max(4, stream["prompts"] // 4)
    return out


def warm_up(endpoint: str, workloads: dict, workdir: Path, tag: str) -> None:
    """A quarter-size pass of each workload on a fresh setup, before anything is measured, with
    other prompts (other seeds), its results discarded: a setup's first requests meet cold state
    that later ones never pay (oneDNN kernels for shapes not seen yet, allocator growth, the
    first connections), and every setup gets the same pass."""
    for name, workload in workloads.items():
        cold = quarter(workload)
        for stream in cold["streams"].values():
            stream["seed"] += WARM_UP_SEED
        run_workload(endpoint, cold, workdir, f"{tag}-warmup-{name}")


WORKLOADS = {
    "steady": {
        "itl_stream": "short",
        "streams": {"short": dict(input_len=512, output_len=64, prompts=160, rate=4.0, seed=1)},
    },
    # One long prefill stalls every stream decoding on the same engine once. The long prompts
    # arrive at 1/s so that those stalls come near the 1% of ITL samples a p99 resolves (at
    # 0.5/s they stayed well under it); each run's share is in the report's tail table.
    "interference": {
        "itl_stream": "decode",
        "streams": {
            "decode": dict(input_len=128, output_len=256, prompts=48, rate=1.5, seed=2),
            "long": dict(input_len=1536, output_len=8, prompts=28, rate=1.0, seed=3),
        },
    },
    # Diagnostic, no target: interference with long prompts twice as long, so that one long
    # prefill outlasts the 100 ms gap of the first SLO pair on any machine (a 1536-token prefill
    # takes ~100-500 ms on the 2-core VMs this runs on, so `interference` at S 100 measures the
    # machine as much as the setup).
    "interference-3k": {
        "itl_stream": "decode",
        "streams": {
            "decode": dict(input_len=128, output_len=256, prompts=48, rate=1.5, seed=2),
            "long": dict(input_len=3072, output_len=8, prompts=28, rate=1.0, seed=3),
        },
    },
    # Diagnostic, no target: steady's prompt tokens per second (2048 a second) as 2048-token
    # prompts at 1/s, so pd's fixed handoff cost (router work, the hop) is set against a prefill
    # ~4x as long as steady's 512-token one; every prompt here takes the prefill hop (over the
    # queue rule's 512).
    "steady-2k": {
        "itl_stream": "short",
        "streams": {"short": dict(input_len=2048, output_len=64, prompts=160, rate=1.0, seed=5)},
    },
    # Diagnostic, no target: the steady prompts at a rate where nothing queues, so TTFT shows
    # the fixed cost of the handoff rather than the prefill queue.
    "light": {
        "itl_stream": "short",
        "streams": {"short": dict(input_len=512, output_len=64, prompts=24, rate=0.5, seed=4)},
    },
}


SETUPS = ("pd", "aggregated", "vllm-pd", "pd-classic")
# Diagnostic setups, run only when named: pd routed by least_loaded instead of the default
# cache_aware (what the engines' KV events cost the streams); pd-behind: pd with
# router.decode_ahead off (the continuation sent after the prefill answered); pd-remote: pd with
# conditional disaggregation off (router.local_prefill_max_tokens and local_prefill_queue_tokens 0:
# every prompt, however short and however long prefill's queue, takes the prefill hop; runs 1-11's
# `pd`, whose short prompts queued behind long ones on prefill).
# pd-asked: pd with kv_transfer.one_sided_reads off (every pull asks the producer first).
# pd-unbound, pd-classic-unbound: pd and pd-classic with roles.*.cpu_bind_scope engine (only the
# threads running the forwards bound; decode's front end may run on the prefill's core). Runs
# 29-30 called today's pd and pd-classic `pd-bound` and `pd-classic-bound`.
DIAGNOSTIC_SETUPS = ("pd-least-loaded", "pd-behind", "pd-remote", "pd-asked", "pd-unbound", "pd-classic-unbound")
UNBOUND = "-unbound"
# `pd` and `pd-classic` run the default cluster's router settings (configs/local-cpu.yaml),
# conditional disaggregation included: for short prompts (runs 10-11 called that `pd-local`) and
# by prefill's queue (run 15 called that `pd-queue`); and its engines' binding
# (roles.*.cpu_bind_scope: replica since run 30).
SHIPPED = shipped_config()
SCOPE = SHIPPED["roles"]["decode"].get("cpu_bind_scope", "engine")
LOCAL_PREFILL = {
    key: value
    for key, value in SHIPPED["router"].items()
    if key in ("local_prefill_max_tokens", "local_prefill_queue_tokens")
}


def start_setup(setup: str, workdir: Path) -> contextlib.AbstractContextManager[str]:
    """One of SETUPS or DIAGNOSTIC_SETUPS, started on this machine's 2 cores; its endpoint while
    the context lasts."""
    if setup == "vllm-pd":
        return vllm_pd_setup(workdir, ENGINE_ARGS, MAX_MODEL_LEN, KV_GIB, RoleSection().onednn_cache)
    name, setup = setup, setup.removesuffix(UNBOUND)
    scope = "engine" if name.endswith(UNBOUND) else SCOPE
    mode = "aggregated" if setup == "aggregated" else "disaggregated"
    policy = "least_loaded" if setup == "pd-least-loaded" else None
    router = {
        "decode_ahead": setup != "pd-behind",
        **{key: 0 if setup == "pd-remote" else value for key, value in LOCAL_PREFILL.items()},
    }
    kv = {"one_sided_reads": False} if setup == "pd-asked" else None
    return pdcluster_setup(
        f"bench-{name}", mode, workdir, setup != "pd-classic", policy, router, kv, cpu_bind_scope=scope
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setups",
        nargs="+",
        default=list(SETUPS),
        choices=[*SETUPS, *DIAGNOSTIC_SETUPS],
        help="pd-classic: pdcluster P/D with router.first_token_from_prefill off (decode samples the first token)",
    )
    parser.add_argument("--workloads", nargs="+", default=["steady", "interference", "light"])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (smoke run)")
    parser.add_argument("--no-warm-up", action="store_true", help="measure from the setup's first request")
    add_client_args(parser)
    args = parser.parse_args(argv)
    client_settings(args)
    workloads = {name: quarter(WORKLOADS[name]) if args.quick else WORKLOADS[name] for name in args.workloads}

    raw: dict = {}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdcluster-serve-") as tmp:
        workdir = Path(tmp)
        for setup in args.setups:
            try:
                with start_setup(setup, workdir) as endpoint:
                    if not args.no_warm_up:
                        warm_up(endpoint, workloads, workdir, setup)
                    for name, workload in workloads.items():
                        before, cpu_before, t0 = scrape(endpoint), cpu_snapshot(), time.monotonic()
                        results = run_workload(endpoint, workload, workdir, f"{setup}-{name}")
                        cpu = cpu_profile(cpu_before, cpu_snapshot(), time.monotonic() - t0)
                        raw.setdefault(setup, {})[name] = {
                            "results": results,
                            "profile": profile(before, scrape(endpoint)),
                            "cpu": cpu,
                        }
                        print(setup, name, json.dumps({s: summarize(r) for s, r in results.items()}), flush=True)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                notes[setup] = str(exc)[-2000:]
                print(f"{setup} failed: {exc}", flush=True)
    report(raw, notes, workloads, args, ENGINE_ARGS, MAX_MODEL_LEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
