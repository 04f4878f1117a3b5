"""pd's TTFT gain, request by request: both first-token paths in one cluster, in alternation.

bench/first_token_path.py compares setups started one after another; on a shared 2-core VM the
machine's speed drifts by tens of percent between them (the same prefill takes 340-480 ms a few
minutes apart), more than the gain it looks for (the handoff pd-classic pays before token 1,
~20-30 ms). Here one `pd` cluster serves both paths, in pairs of requests run back to back in a
random order: an ordinary streaming request takes the continuation (the prefill's token streamed
at once, decode sent ahead), and the same request with a `seed` takes the classic path (the router
continues only requests whose meaning survives the split, continuation.py: decode would draw its
second token from a fresh generator; with greedy sampling the seed changes no token), decode
sampling token 1 after the handoff. What the two paths' TTFTs differ by, pair by pair, is the
path's own cost: the drift is shared by both requests of a pair.

The router's own counters (`pdcluster_first_token_source_total`, `pdcluster_decode_ahead_total`)
must show every request took its intended path, or the run fails.

Writes bench/results/<date>-first-token-paired.{md,json}.
Usage: python bench/first_token_paired.py [--pairs 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    TEXT_IDS,
    machine,
    metric_samples,
    process_role,
    stream_completion,
    write_results,
)
from bench.first_token_path import OUTPUT_LEN, PROMPT_LEN, WARM_UP  # noqa: E402
from bench.serve import start_setup  # noqa: E402
from bench.serve_client import thread_ns  # noqa: E402

PATHS = ("continued", "classic")  # token 1 from the prefill (pd) / from decode (pd-classic's path)


def path_counters(endpoint: str) -> dict[str, float]:
    """The router's counts of first tokens by source and of continuations sent ahead, by outcome."""
    text = httpx.get(endpoint + "/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for name, labels, value in metric_samples(text):
        if name == "pdcluster_first_token_source_total":
            counts[f"source:{labels['role']}"] = value
        elif name == "pdcluster_decode_ahead_total":
            counts[f"ahead:{labels['outcome']}"] = value
    return counts


def prefill_phase_sum(endpoint: str) -> float:
    """The router's summed prefill phases (router -> prefill -> router, lease included), seconds."""
    text = httpx.get(endpoint + "/metrics", timeout=10).text
    return sum(v for name, _, v in metric_samples(text) if name == "pdcluster_prefill_seconds_sum")


def engine_threads(role: str) -> list[tuple[int, int]]:
    """(pid, tid) of the threads of `role`'s vLLM engine-core processes that carry the process's
    name: its main thread, the busy loop that runs the forwards (bound to the role's cores by
    engine/single_process.py), and the helper threads it started unnamed."""
    import psutil

    threads = []
    for proc in psutil.process_iter():
        if process_role(proc).startswith(f"{role} > VLLM::EngineCore"):
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                with open(f"/proc/{proc.pid}/task/{tid}/comm") as f:
                    if f.read().startswith("VLLM::EngineCor"):
                        threads.append((proc.pid, int(tid)))
    if not threads:
        raise RuntimeError(f"no {role} engine-core thread found")
    return threads


def thread_times(threads: list[tuple[int, int]]) -> tuple[float, float]:
    """Seconds those threads spent on a CPU and runnable waiting for one (the kernel's schedstat)."""
    times = [thread_ns(tid, pid) for pid, tid in threads]
    return sum(on for on, _ in times) / 1e9, sum(queued for _, queued in times) / 1e9


def request(client: httpx.Client, rng: random.Random, path: str, seed: int, probe=None) -> dict:
    """One request; with `probe` (the endpoint and the prefill's engine threads) also its router
    prefill phase and the prefill engine thread's time on a CPU / waiting for one meanwhile."""
    prompt = [rng.randrange(TEXT_IDS.start, TEXT_IDS.stop) for _ in range(PROMPT_LEN)]
    extra = {"seed": seed} if path == "classic" else {}
    if probe:
        phase0, (cpu0, wait0) = prefill_phase_sum(probe[0]), thread_times(probe[1])
    timing = stream_completion(client, "tiny", prompt, OUTPUT_LEN, **extra)
    if timing.error or timing.ttft is None or not timing.itls:
        raise RuntimeError(f"{path} request failed: {timing.error}")
    row = {"ttft_ms": timing.ttft * 1e3, "gap_1_2_ms": timing.itls[0] * 1e3}
    if probe:
        # read after the stream ended: the decode half's work is counted on decode, not here
        cpu1, wait1 = thread_times(probe[1])
        row |= {
            "prefill_phase_ms": (prefill_phase_sum(probe[0]) - phase0) * 1e3,
            "prefill_cpu_ms": (cpu1 - cpu0) * 1e3,
            "prefill_wait_ms": (wait1 - wait0) * 1e3,
        }
    return row


def measure(pairs: int, seed: int, unbound: bool = False) -> dict:
    """One fresh `pd` cluster: the pairs' timings, and the paths the router counted; `unbound`:
    the cluster binds only its engines' forward threads (roles.*.cpu_bind_scope engine)."""
    rng = random.Random(seed)
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="pdcluster-ftpair-") as tmp,
        start_setup("pd-unbound" if unbound else "pd", Path(tmp)) as endpoint,
    ):
        with httpx.Client(base_url=endpoint, timeout=120) as client:
            for i in range(WARM_UP):
                request(client, rng, PATHS[i % 2], seed=i)
            before = path_counters(endpoint)
            probe = (endpoint, engine_threads("prefill actor"))
            for i in range(pairs):
                order = list(PATHS)
                rng.shuffle(order)
                pair = {path: request(client, rng, path, seed=i, probe=probe) for path in order}
                rows.append({**pair, "first": order[0]})
            after = path_counters(endpoint)
    counted = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    expected = {"source:prefill": pairs, "source:decode": pairs, "ahead:streamed": pairs}
    wrong = {key: counted.get(key, 0.0) for key, n in expected.items() if counted.get(key, 0.0) != n}
    if wrong:
        raise RuntimeError(f"requests did not take their paths: counted {wrong}, expected {pairs} each")
    return {"pairs": rows, "counted": counted, "unbound": unbound}


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and its distribution-free 95 % interval (order statistics of the sign test)."""
    d, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    return statistics.median(d), d[min(k, n - 1)], d[max(n - 1 - k, 0)]


def where_it_went(pairs: list[dict]) -> list[str]:
    """The gain taken apart: what the continuation's prefill phase costs against the classic one's
    (decode_ahead's work beside the prefill), and the handoff the classic path pays before token 1."""
    lines = [
        "",
        "Where the time went, per path (medians over the pairs): the router's prefill phase (router → prefill → "
        "router); after it, until the client's token 1; the prefill engine core's threads (engine_threads) over "
        "the whole request, on a CPU and runnable but waiting for one (the kernel's schedstat):",
        "",
        "| path | prefill phase ms | prefill phase → token 1 ms | prefill engine on a CPU ms | waiting for a CPU ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for path in PATHS:
        rows = [p[path] for p in pairs]
        cells = [
            statistics.median(r["prefill_phase_ms"] for r in rows),
            statistics.median(r["ttft_ms"] - r["prefill_phase_ms"] for r in rows),
            statistics.median(r["prefill_cpu_ms"] for r in rows),
            statistics.median(r["prefill_wait_ms"] for r in rows),
        ]
        lines.append(f"| {path} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    phase = median_interval([p["continued"]["prefill_phase_ms"] - p["classic"]["prefill_phase_ms"] for p in pairs])
    wait = median_interval([p["continued"]["prefill_wait_ms"] - p["classic"]["prefill_wait_ms"] for p in pairs])
    lines += [
        "",
        f"Per pair, continued − classic: prefill phase **{phase[0]:.1f} ms** [95 % {phase[1]:.1f} to {phase[2]:.1f}]; "
        f"the prefill engine waiting for a CPU {wait[0]:.1f} ms [{wait[1]:.1f} to {wait[2]:.1f}].",
    ]
    return lines


def report(runs: list[dict]) -> str:
    pairs = [p for run in runs for p in run["pairs"]]
    saved = [p["classic"]["ttft_ms"] - p["continued"]["ttft_ms"] for p in pairs]
    ratio = [p["continued"]["ttft_ms"] / p["classic"]["ttft_ms"] for p in pairs]
    lines = [
        "# pd's TTFT gain, request by request: both first-token paths in one cluster",
        "",
        f"{len(runs)} fresh `pd` clusters (1 prefill on core 0, 1 decode on core 1, bench/serve.py's engines); in "
        f"each, {WARM_UP} unmeasured requests, then {len(runs[0]['pairs'])} pairs run back to back in a random order: "
        f"the same kind of request ({PROMPT_LEN} random token ids, {OUTPUT_LEN} output tokens, greedy) through "
        "the continuation (token 1 from the prefill, decode sent ahead) and, with a `seed`, through the classic "
        "path (decode samples token 1 after the handoff). The router's counters confirmed every request's path."
        + (
            " Only the engines' forward threads were bound (roles.*.cpu_bind_scope engine, --unbound)."
            if runs[0].get("unbound")
            else ""
        ),
        "",
        "| path | TTFT p50 ms | TTFT p90 ms | token 1 → 2 gap p50 ms | token 2 at p50 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for path in PATHS:
        ttft = sorted(p[path]["ttft_ms"] for p in pairs)
        gap = [p[path]["gap_1_2_ms"] for p in pairs]
        second = [p[path]["ttft_ms"] + p[path]["gap_1_2_ms"] for p in pairs]
        lines.append(
            f"| {path} | {statistics.median(ttft):.1f} | {ttft[int(0.9 * (len(ttft) - 1))]:.1f} | "
            f"{statistics.median(gap):.1f} | {statistics.median(second):.1f} |"
        )
    mid, low, high = median_interval(saved)
    rmid, rlow, rhigh = median_interval(ratio)
    first_won = sum(1 for p in pairs if p["continued"]["ttft_ms"] < p["classic"]["ttft_ms"])
    if all("prefill_phase_ms" in p[path] for p in pairs for path in PATHS):
        lines += where_it_went(pairs)
    lines += [
        "",
        f"Per pair, classic TTFT − continued TTFT: median **{mid:.1f} ms** [95 % {low:.1f} to {high:.1f}]; "
        f"continued / classic TTFT: median **{rmid:.3f}×** [{rlow:.3f}-{rhigh:.3f}]; the continuation was first "
        f"in {first_won} of {len(pairs)} pairs.",
        "",
        "Per cluster: "
        + "; ".join(
            f"run {i}: median saved {statistics.median(p['classic']['ttft_ms'] - p['continued']['ttft_ms'] for p in run['pairs']):.1f} ms, "
            f"classic TTFT p50 {statistics.median(p['classic']['ttft_ms'] for p in run['pairs']):.0f} ms"
            for i, run in enumerate(runs)
        ),
        "",
        f"Machine: {machine()}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="fresh clusters")
    parser.add_argument(
        "--unbound",
        action="store_true",
        help="clusters with roles.*.cpu_bind_scope engine (bench/serve.py's pd-unbound)",
    )
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        runs.append(measure(args.pairs, seed=repeat, unbound=args.unbound))
        print(f"run {repeat}: {runs[-1]['counted']}", flush=True)
    print(write_results("first-token-paired", {"runs": runs, "machine": machine()}, report(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
