"""The first-token path's floor: TTFT and the token 1 -> 2 gap of a long prompt on an idle cluster.

Where the P/D handoff sits decides which gap the client sees it in. `pd-classic` pays it before
the first token (decode pulls the KV, then samples token 1); `pd` streams the prefill's token at
once and pays the handoff between tokens 1 and 2; `pd-behind` is `pd` with router.decode_ahead off
(the continuation leaves only once the prefill answered). One request at a time, so the numbers
are the path's own cost, not queueing: bench/serve_sweep.py measures the same setups under load.

Setups of bench/serve.py (1 prefill on core 0, 1 decode on core 1), started afresh per repeat in
rotated order; in each, WARM_UP requests unmeasured, then REQUESTS prompts of PROMPT_LEN random
token ids, OUTPUT_LEN tokens each, timed per token by our streaming client.

Writes bench/results/<date>-first-token-path.{md,json}.
Usage: python bench/first_token_path.py [--setups pd pd-behind pd-classic] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import TEXT_IDS, machine, rotated, stream_completion, write_results  # noqa: E402
from bench.serve import start_setup  # noqa: E402
from bench.serve_profile import profile, scrape  # noqa: E402

SETUPS = ("pd", "pd-behind", "pd-classic")
PROMPT_LEN, OUTPUT_LEN = 1536, 8  # the interference workload's long prompts (bench/serve.py)
WARM_UP, REQUESTS = 5, 40


def measure(setup: str, seed: int) -> tuple[list[dict], dict]:
    """The measured requests' timings, and the handoff's stages over them (bench/serve.profile)."""
    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdcluster-ftp-") as tmp, start_setup(setup, Path(tmp)) as endpoint:
        with httpx.Client(base_url=endpoint, timeout=120) as client:
            for i in range(WARM_UP + REQUESTS):
                if i == WARM_UP:
                    before = scrape(endpoint)
                prompt = [rng.randrange(TEXT_IDS.start, TEXT_IDS.stop) for _ in range(PROMPT_LEN)]
                timing = stream_completion(client, "tiny", prompt, OUTPUT_LEN)
                if timing.error or timing.ttft is None or not timing.itls:
                    raise RuntimeError(f"{setup}: request {i} failed: {timing.error}")
                if i >= WARM_UP:
                    rows.append({"ttft_ms": timing.ttft * 1e3, "gaps_ms": [g * 1e3 for g in timing.itls]})
            stages = profile(before, scrape(endpoint))
    return rows, stages


STAGES = {  # the handoff, in order (bench/serve.profile): mean ms per request
    "kv_lease_wait_mean_ms": "lease filed → pull starts",
    "kv_pull_mean_ms": "pull",
    "kv_pull_cpu_mean_ms": "of it on a CPU",
    "kv_pull_runqueue_mean_ms": "of it waiting for a CPU",
    "kv_load_report_mean_ms": "bytes in → vLLM told",
    "handoff_gap_mean_ms": "router: prefill's token → decode's first",
}


def summary(measured: tuple[list[dict], dict]) -> dict:
    rows, stages = measured
    return {
        **{key: stages.get(key) for key in STAGES},
        # the router's prefill phase (request sent -> prefill's answer): where a setup's TTFT
        # differs before any handoff
        "prefill_phase_mean_ms": stages.get("prefill_phase_mean_ms"),
        "requests": len(rows),
        "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in rows),
        "gap_1_2_p50_ms": statistics.median(r["gaps_ms"][0] for r in rows),
        "gap_1_2_max_ms": max(r["gaps_ms"][0] for r in rows),
        "later_gap_p50_ms": statistics.median(g for r in rows for g in r["gaps_ms"][1:]),
        "second_token_p50_ms": statistics.median(r["ttft_ms"] + r["gaps_ms"][0] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--repeats", type=int, default=2, help="every setup started afresh, in rotated order")
    args = parser.parse_args(argv)
    raw: dict[str, list[dict]] = {s: [] for s in args.setups}
    for repeat in range(args.repeats):
        for setup in rotated(args.setups, repeat):
            raw[setup].append(summary(measure(setup, seed=repeat)))
            print(setup, repeat, raw[setup][-1], flush=True)
    report(raw)
    return 0


def median_of(raw: dict, setup: str, key: str) -> float:
    return statistics.median(r[key] for r in raw[setup])


def report(raw: dict) -> None:
    keys = ("ttft_p50_ms", "gap_1_2_p50_ms", "second_token_p50_ms", "later_gap_p50_ms", "prefill_phase_mean_ms")
    lines = [
        "# The first-token path on an idle cluster: TTFT and the token 1 → 2 gap",
        "",
        f"One request at a time: {REQUESTS} prompts of {PROMPT_LEN} random token ids, {OUTPUT_LEN} output tokens, "
        f"after {WARM_UP} unmeasured; 1 prefill (core 0) + 1 decode (core 1), bench/serve.py's engines; "
        f"{len(next(iter(raw.values())))} repeats, each setup started afresh, rotated order. Per setup: the median "
        "over the repeats of each repeat's p50 [min-max]; the router's prefill phase (prefill request sent → its "
        "answer) is a mean per repeat. TTFT vs pd-classic: per round (the setups run back to back), the "
        "ratio of the two p50s, median [min-max] over the rounds: the machine's drift between rounds cancels.",
        "",
        "| setup | TTFT p50 ms | token 1 → 2 gap p50 ms | token 2 at p50 ms | later gaps p50 ms | "
        "router: prefill phase ms | largest 1 → 2 gap ms | TTFT vs pd-classic |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, repeats in raw.items():
        cells = [
            f"{median_of(raw, setup, k):.1f} [{min(r[k] for r in repeats):.1f}-{max(r[k] for r in repeats):.1f}]"
            for k in keys
        ]
        versus = "-"
        if "pd-classic" in raw:
            ratios = [r["ttft_p50_ms"] / c["ttft_p50_ms"] for r, c in zip(repeats, raw["pd-classic"])]
            versus = f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}-{max(ratios):.2f}]"
        lines.append(f"| {setup} | {' | '.join(cells)} | {max(r['gap_1_2_max_ms'] for r in repeats):.1f} | {versus} |")
    lines += [
        "",
        "Where the handoff's time goes, from the cluster's own metrics (/metrics; mean ms per request, "
        "median over the repeats): the lease filed on the prefill replica → its pull starts on decode "
        "(lookup) → the pull → vLLM hears of the bytes; the router's handoff gap is the prefill's token "
        "→ decode's first one as relayed (it holds those stages, minus what overlaps the prefill "
        "answer's way to the router, plus a decode step).",
        "",
        f"| setup | {' | '.join(STAGES.values())} |",
        f"|---|{'---:|' * len(STAGES)}",
    ]
    for setup, repeats in raw.items():
        cells = []
        for key in STAGES:
            values = [r[key] for r in repeats if r.get(key) is not None]
            cells.append(f"{statistics.median(values):.1f}" if values else "-")
        lines.append(f"| {setup} | {' | '.join(cells)} |")
    lines += ["", f"Machine: {machine()}"]
    print(write_results("first-token-path", {"raw": raw, "machine": machine()}, "\n".join(lines) + "\n"))


if __name__ == "__main__":
    sys.exit(main())
