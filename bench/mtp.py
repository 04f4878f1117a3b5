"""MTP benchmark through the cluster: decode speed with MTP off vs k=1 (vs k=2), batch 1.

For each setting the same P/D cluster (configs/local-cpu.yaml, tiny model) is launched through
`pdcluster up`, warmed up, and sent the same held-out prompts one at a time (batch 1, greedy,
fixed output length). Inter-token latency is measured per token from vLLM's continuous usage
stats in the SSE stream; decode throughput is output tokens per second of decode time. The
decode replica's acceptance counters come from `pdcluster status --json`. Results:
bench/results/<date>-mtp.{json,md}.

Usage: python bench/mtp.py [--prompts 20] [--max-tokens 128] [--k 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, base_config, cluster, machine, status, stream_completion, summarize, write_results  # noqa: E402


def run_setting(k: int, prompts: list[str], max_tokens: int, workdir: Path) -> dict:
    overrides = {"speculative": {"method": "mtp", "num_speculative_tokens": k} if k else None}
    config = base_config(f"bench-mtp-k{k}", **overrides)
    with cluster(config, workdir) as endpoint, httpx.Client(base_url=endpoint, timeout=300) as client:
        for prompt in prompts[:2]:  # warm-up
            stream_completion(client, "tiny", prompt, 16)
        before = _decode_stats(config, workdir)
        timings = []
        started = time.perf_counter()
        for prompt in prompts:
            timings.append(stream_completion(client, "tiny", prompt, max_tokens))
        wall = time.perf_counter() - started
        after = _decode_stats(config, workdir)
    summary = summarize(timings, wall)
    decode_time = sum(t.e2e - (t.ttft or 0) for t in timings if t.ok)
    decode_tokens = sum(max(0, t.tokens - 1) for t in timings if t.ok)
    summary["decode_tokens_per_s"] = decode_tokens / decode_time if decode_time else None
    drafts = after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    rounds = after.get("spec_drafts", 0) - before.get("spec_drafts", 0)
    summary["k"] = k
    summary["acceptance_rate"] = accepted / drafts if drafts else None
    summary["mean_accepted_length"] = 1 + accepted / rounds if rounds else None
    return summary


def _decode_stats(config: dict, workdir: Path) -> dict:
    rows = status(config, workdir)["replicas"]
    return next(r["stats"] for r in rows if r["role"] == "decode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args(argv)
    lines = (MODEL / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: args.prompts]
    results = []
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-") as tmp:
        for k in args.k:
            summary = run_setting(k, prompts, args.max_tokens, Path(tmp))
            results.append(summary)
            print(json.dumps(summary), flush=True)
    base = next(r for r in results if r["k"] == 0)
    table = [
        "| MTP | decode tok/s | vs off | ITL p50 ms | ITL p99 ms | TTFT p50 ms | acceptance | mean accepted length | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["speedup_vs_off"] = ratio
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        table.append(
            f"| {'off' if r['k'] == 0 else 'k=' + str(r['k'])} | {r['decode_tokens_per_s']:.1f} | {ratio:.2f}x | "
            f"{r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['ttft_p50_ms']} | {acc} | {mal} | {r['failed']} |"
        )
    k1 = next((r for r in results if r["k"] == 1), None)
    verdict = ""
    if k1 is not None:
        met = k1["speedup_vs_off"] >= 1.3
        verdict = f"Target MTP k=1 decode throughput >= 1.3x off at batch 1: **{'met' if met else 'MISSED'}** ({k1['speedup_vs_off']:.2f}x)."
    markdown = "\n".join(
        [
            "# MTP through the P/D cluster (batch 1)",
            "",
            f"{len(prompts)} held-out prompts, one at a time, greedy, {args.max_tokens} output tokens each "
            "(ignore_eos), 1 prefill + 1 decode replica (configs/local-cpu.yaml), tiny model. "
            "ITL per token from vLLM's continuous usage stats; decode tok/s = tokens after the first / "
            "time after the first token.",
            "",
            *table,
            "",
            verdict,
            "",
            "With MTP a decode step can emit several tokens, which reach the client back to back: per-token",
            "ITL becomes bimodal (p50 near zero at k=2), so decode tok/s is the comparable speed measure.",
            "",
        ]
    )
    path = write_results("mtp", {"machine": machine(), "args": vars(args), "results": results}, markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
