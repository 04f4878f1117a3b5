"""Cache-aware routing benchmark: `cache_aware` vs `least_loaded` (and `round_robin`), same run.

Each policy gets a fresh cluster (so each starts with cold caches) of 2 prefill replicas (both
bound to core 0: one core of prefill compute, however it is split) and 1 decode replica (core 1).
The prefill caches are sized in blocks (num_gpu_blocks_override) so that the workload's prefixes
fit in the two prefill caches together but not in one. Workloads, in this order on each cluster:
  prefix   `vllm bench serve --dataset-name prefix_repetition`: PREFIXES shared prefixes, each
           request one of them plus its own suffix (vLLM's own client computes TTFT)
  random   `vllm bench serve --dataset-name random`, same lengths, nothing shared: the check that
           cache-aware routing costs nothing where there is nothing to gain
  random-prefix  the same with `--random-prefix-len`: one prefix all requests share (each prefill
           cache holds it: the load term must keep both replicas busy)
  chat     multi-turn chats whose prefix grows each turn (our driver, bench/common.py): each
           conversation's own long system prompt, then turns that append the answer and a new
           question
Prefix hits are vLLM's own: the prefill engines' prefix-cache counters (queried and hit prompt
tokens), read before and after each workload. `cache_aware+local` also turns on conditional
disaggregation (router.local_prefill_max_tokens): requests whose decode replica holds all but a
few tokens of the prompt skip the prefill hop.

The prefix workload can run at several request rates (--prefix-rates, ascending, on the same
cluster): at a light load a hit saves prefill compute only, and the fixed costs per request
(router, prefill hop, first token) bound the ratio; as the load grows, cache-blind routing
recomputes shared prefixes and queues on the prefill core while cache-aware routing does not.
Each row reports the request throughput achieved against the offered rate.

Writes bench/results/<date>-prefix-routing.{md,json}.
Usage: python bench/prefix_routing.py [--setups least_loaded cache_aware round_robin cache_aware+local]
       [--workloads prefix random random-prefix chat] [--prefix-rates 3 4 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    MODEL,
    TEXT_IDS,
    base_config,
    cluster,
    machine,
    metric_samples,
    status,
    stream_completion,
    summarize,
    write_results,
)
from bench.serve import add_client_args, bench_serve, client_settings  # noqa: E402
from bench.serve_report import summarize as summarize_serve  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 1536, 128, 16
PREFIXES = 8  # 8 x 12 blocks = 96 blocks of prefixes
PREFILL_BLOCKS = 72  # one prefill cache holds 6 prefixes' blocks, the two together all 8 and room to work
DECODE_BLOCKS = 512
RATE = 3.0  # requests/s (Poisson); the prefix workload's rates: --prefix-rates
PROMPTS = 160
CHATS, TURNS, SYSTEM_LEN, TURN_LEN = 8, 4, 1024, 64
LOCAL_MAX = 2 * BLOCK
SETUPS = {
    "least_loaded": {"policy": "least_loaded"},
    "cache_aware": {"policy": "cache_aware"},
    "round_robin": {"policy": "round_robin"},
    "cache_aware+local": {"policy": "cache_aware", "local_prefill_max_tokens": LOCAL_MAX},
}


def config(setup: str) -> dict:
    args = {"enforce_eager": True, "max_num_seqs": 64, "max_num_batched_tokens": 4096}
    return base_config(
        f"bench-prefix-{setup.replace('+', '-').replace('_', '-')}",
        model={"max_model_len": 4096},
        roles={
            "prefill": {
                "replicas": 2,
                "cpu_bind": ["0", "0"],
                "engine_args": {**args, "num_gpu_blocks_override": PREFILL_BLOCKS},
            },
            "decode": {
                "replicas": 1,
                "cpu_bind": ["1"],
                "engine_args": {**args, "num_gpu_blocks_override": DECODE_BLOCKS},
            },
        },
        router=SETUPS[setup],
    )


def prefix_counters(cfg: dict, workdir: Path) -> dict[str, int]:
    """vLLM's prefix-cache counters, summed over the prefill replicas."""
    rows = [r for r in status(cfg, workdir)["replicas"] if r["role"] == "prefill"]
    return {k: sum((r["stats"] or {}).get(f"prefix_cache_{k}", 0) for r in rows) for k in ("queries", "hits")}


def routes(endpoint: str) -> dict[str, float]:
    text = httpx.get(endpoint + "/metrics", timeout=30).text
    return {
        labels["path"]: value
        for name, labels, value in metric_samples(text)
        if name == "pdcluster_route_decisions_total"
    }


def serve_workload(endpoint: str, workdir: Path, tag: str, dataset: list[str], prompts: int, rate: float) -> dict:
    out = workdir / f"{tag}.json"
    proc = bench_serve(endpoint, out, prompts=prompts, rate=rate, seed=7, dataset=dataset)
    if proc.wait(3600) != 0:
        raise RuntimeError(f"vllm bench serve failed ({tag}): {out.with_suffix('.log').read_text()[-3000:]}")
    return json.loads(out.read_text())


def chat_workload(endpoint: str) -> dict:
    """CHATS conversations at once, TURNS turns each; every turn's TTFT (our client)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))

    def text(n: int, seed: int) -> str:
        return tokenizer.decode([TEXT_IDS[(seed * 7919 + i * 104729) % len(TEXT_IDS)] for i in range(n)])

    def conversation(c: int):
        timings = []
        messages = [{"role": "system", "content": text(SYSTEM_LEN, c)}]
        with httpx.Client(base_url=endpoint, timeout=600) as client:
            for t in range(TURNS):
                messages.append({"role": "user", "content": text(TURN_LEN, 1000 * c + t)})
                timing = stream_completion(client, "tiny", None, OUTPUT_LEN, messages=messages)
                timings.append(timing)
                messages.append({"role": "assistant", "content": text(OUTPUT_LEN, 5000 * c + t)})
        return timings

    start = time.perf_counter()
    with ThreadPoolExecutor(CHATS) as pool:
        timings = [t for conv in pool.map(conversation, range(CHATS)) for t in conv]
    return summarize(timings, time.perf_counter() - start)


WORKLOADS = ("prefix", "random", "random-prefix", "chat")


def label(name: str, rate: float) -> str:
    """A result's key: the workload, and its rate where it is not RATE."""
    return name if rate == RATE else f"{name} {rate:g}/s"


def run_setup(setup: str, workdir: Path, prompts: int, names: list[str], prefix_rates: list[float]) -> dict:
    cfg = config(setup)
    results: dict = {}
    with cluster(cfg, workdir) as endpoint:
        wait_following(cfg, workdir, setup)
        workloads = {
            "prefix": [
                "--dataset-name",
                "prefix_repetition",
                "--prefix-repetition-prefix-len",
                str(PREFIX_LEN),
                "--prefix-repetition-suffix-len",
                str(SUFFIX_LEN),
                "--prefix-repetition-num-prefixes",
                str(PREFIXES),
                "--prefix-repetition-output-len",
                str(OUTPUT_LEN),
            ],
            "random": [
                "--dataset-name",
                "random",
                "--random-input-len",
                str(PREFIX_LEN + SUFFIX_LEN),
                "--random-output-len",
                str(OUTPUT_LEN),
            ],
            # one prefix every request shares (vLLM's random dataset with --random-prefix-len)
            "random-prefix": [
                "--dataset-name",
                "random",
                "--random-prefix-len",
                str(PREFIX_LEN),
                "--random-input-len",
                str(SUFFIX_LEN),
                "--random-output-len",
                str(OUTPUT_LEN),
            ],
        }
        runs = [(n, r) for n in names for r in (sorted(prefix_rates) if n == "prefix" else [RATE])]
        for name, rate in runs:
            before, routes_before = prefix_counters(cfg, workdir), routes(endpoint)
            if name == "chat":
                summary = chat_workload(endpoint)
            else:
                result = serve_workload(endpoint, workdir, f"{setup}-{name}-{rate:g}", workloads[name], prompts, rate)
                summary = {
                    **summarize_serve(result),
                    "offered_rps": rate,
                    "achieved_rps": result.get("request_throughput"),
                }
            after, routes_after = prefix_counters(cfg, workdir), routes(endpoint)
            queried = after["queries"] - before["queries"]
            summary["prefill_prefix_hit_rate"] = (after["hits"] - before["hits"]) / queried if queried else None
            summary["routes"] = {k: routes_after[k] - routes_before.get(k, 0) for k in routes_after}
            results[label(name, rate)] = summary
            print(setup, label(name, rate), json.dumps(summary), flush=True)
    return results


def wait_following(cfg: dict, workdir: Path, setup: str) -> None:
    """Under cache_aware, the router follows every replica's events before the load starts."""
    if SETUPS[setup]["policy"] != "cache_aware":
        return
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        cache = status(cfg, workdir).get("cache") or {}
        replicas = cache.get("replicas") or {}
        if cache.get("hashing") and len(replicas) == 3 and all(c["source"] == "events" for c in replicas.values()):
            return
        time.sleep(1)  # status is polled
    raise RuntimeError(f"{setup}: the router did not follow every replica's KV events")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--prefix-rates", nargs="+", type=float, default=[RATE], help="the prefix workload's request rates (req/s)"
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (smoke run)")
    add_client_args(parser)  # the load generator's priority (bench/serve.py)
    args = parser.parse_args(argv)
    client_settings(args)
    prompts = PROMPTS // 4 if args.quick else PROMPTS
    raw: dict = {}
    with tempfile.TemporaryDirectory(prefix="pdcluster-prefix-") as tmp:
        for setup in args.setups:
            raw[setup] = run_setup(setup, Path(tmp), prompts, args.workloads, args.prefix_rates)
    report(raw, prompts)
    return 0


def ratio(raw: dict, setup: str, workload: str, key: str, base: str = "least_loaded") -> float | None:
    a, b = raw.get(setup, {}).get(workload, {}).get(key), raw.get(base, {}).get(workload, {}).get(key)
    return round(a / b, 3) if a is not None and b else None


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def report(raw: dict, prompts: int) -> None:
    lines = [
        "# Cache-aware routing: cache_aware vs least_loaded (vs round_robin), same run",
        "",
        f"2 prefill replicas (core 0, {PREFILL_BLOCKS} blocks of {BLOCK} tokens each) + 1 decode (core 1, "
        f"{DECODE_BLOCKS} blocks); prefix workload: {PREFIXES} prefixes of {PREFIX_LEN} tokens "
        f"({PREFIXES * PREFIX_LEN // BLOCK} blocks: more than one prefill cache, less than two) + "
        f"{SUFFIX_LEN}-token suffixes, {OUTPUT_LEN} output tokens, {prompts} requests at {RATE}/s unless the workload names its rate; random: the same "
        f"lengths, nothing shared; chat: {CHATS} conversations x {TURNS} turns ({SYSTEM_LEN}-token system prompt, "
        f"{TURN_LEN}-token questions). TTFT/ITL of prefix and random by `vllm bench serve`; hit rate: the prefill "
        "engines' own prefix-cache counters.",
        "",
        "| setup | workload | req/s achieved | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | failed | "
        "prefill prefix hit rate | routes | TTFT p50 vs least_loaded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, workloads in raw.items():
        for name, s in workloads.items():
            failed = s.get("failed") or 0
            hit = s.get("prefill_prefix_hit_rate")
            achieved = s.get("achieved_rps")
            lines.append(
                f"| {setup} | {name} | {'-' if achieved is None else f'{achieved:.2f}'} | {fmt(s.get('ttft_p50_ms'))} | {fmt(s.get('ttft_p99_ms'))} | "
                f"{fmt(s.get('itl_p50_ms'))} | "
                f"{failed} | {'-' if hit is None else f'{hit:.2f}'} | {s.get('routes')} | "
                f"{ratio(raw, setup, name, 'ttft_p50_ms')} |"
            )
    prefix = [w for w in raw.get("cache_aware", {}) if w.split()[0] == "prefix"]
    lines += [
        "",
        "Targets: prefix TTFT p50 cache_aware <= 0.3x least_loaded: "
        + ", ".join(f"{w}: **{ratio(raw, 'cache_aware', w, 'ttft_p50_ms')}x**" for w in prefix)
        + f"; random TTFT p50 <= 1.05x: **{ratio(raw, 'cache_aware', 'random', 'ttft_p50_ms')}x**.",
        "",
        f"Machine: {json.dumps(machine())}",
    ]
    path = write_results(
        "prefix-routing", {"raw": raw, "machine": machine(), "prompts": prompts}, "\n".join(lines) + "\n"
    )
    print(path)


if __name__ == "__main__":
    sys.exit(main())
