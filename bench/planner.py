"""SLO planner benchmark: a load that shifts from prompt-heavy to decode-heavy, served by the
planner (`autoscale:` act, starting from 1 prefill + 1 decode, budget 3) and by fixed splits
(1P1D, 2P1D, 1P2D: the best fixed split is whichever attains most), each on a fresh cluster.

Phases, back to back, by `vllm bench serve` (random dataset, --save-detailed):
  prompt   long prompts, few output tokens: TTFT is what suffers
  decode   short prompts, long outputs: inter-token gaps are what suffer
Per phase, SLO attainment: the share of requests whose TTFT ≤ T and whose largest inter-token
gap ≤ S (bench/common.py SLOS, the pairs every serving benchmark uses). On these 2 cores a
third engine shares a core with another: what the planner can buy is a different split of the
same CPU, not more of it.

Writes bench/results/<date>-planner.{md,json}.
Usage: python bench/planner.py [--setups planner 1p1d 2p1d 1p2d] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    SLOS,
    attainment,
    base_config,
    cluster,
    machine,
    mark_cut_streams,
    slo_key,
    status,
    write_results,
)
from bench.serve import add_client_args, bench_serve, client_settings, random_dataset  # noqa: E402

PHASES = {
    "prompt": dict(input_len=3000, output_len=8, rate=2.0, seconds=60, seed=11),
    "decode": dict(input_len=64, output_len=256, rate=1.5, seconds=60, seed=12),
}
ARGS = {"enforce_eager": True, "max_num_seqs": 64, "max_num_batched_tokens": 4096}
AUTOSCALE = {
    "enabled": True,
    "ttft_p90_ms": 1000,
    "itl_p90_ms": 40,
    "prefill": {"min": 1, "max": 2},
    "decode": {"min": 1, "max": 2},
    "budget": 3,
    "interval_seconds": 2,
    "window_seconds": 10,
    "cooldown_seconds": 10,
    "hysteresis": 2,
}
SETUPS = {"planner": (1, 1, True), "1p1d": (1, 1, False), "2p1d": (2, 1, False), "1p2d": (1, 2, False)}


def config(setup: str) -> dict:
    prefill, decode, planned = SETUPS[setup]
    return base_config(
        f"bench-planner-{setup}",
        model={"max_model_len": 4096},
        roles={
            "prefill": {"replicas": prefill, "cpu_bind": ["0", "1"], "engine_args": ARGS},
            "decode": {"replicas": decode, "cpu_bind": ["1", "0"], "engine_args": ARGS},
        },
        autoscale=AUTOSCALE if planned else {"enabled": False},
    )


def run_setup(setup: str, workdir: Path, scale: float) -> dict:
    cfg = config(setup)
    result: dict = {}
    with cluster(cfg, workdir) as endpoint:
        for phase, p in PHASES.items():
            out = workdir / f"{setup}-{phase}.json"
            prompts = max(4, int(p["rate"] * p["seconds"] * scale))
            proc = bench_serve(
                endpoint, out, prompts=prompts, rate=p["rate"], seed=p["seed"],
                dataset=random_dataset(p["input_len"], p["output_len"]),
            )  # fmt: skip
            if proc.wait(3600) != 0:
                raise RuntimeError(
                    f"vllm bench serve failed ({setup}/{phase}): {out.with_suffix('.log').read_text()[-2000:]}"
                )
            detailed = json.loads(out.read_text())
            mark_cut_streams(detailed, p["output_len"])
            replicas = [(r["role"], r["state"]) for r in status(cfg, workdir)["replicas"]]
            result[phase] = {
                "attainment": attainment(detailed),
                "completed": detailed.get("completed"),
                "failed": detailed.get("failed", 0),
                "ttft_p50_ms": detailed.get("median_ttft_ms"),
                "replicas_after": {
                    role: sum(1 for r, s in replicas if r == role and s == "ready") for role in ("prefill", "decode")
                },
            }
            print(setup, phase, json.dumps(result[phase]), flush=True)
        result["planner"] = status(cfg, workdir).get("planner")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (smoke run)")
    add_client_args(parser)  # the load generator's priority (bench/serve.py)
    args = parser.parse_args(argv)
    client_settings(args)
    raw: dict = {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pdcluster-planner-") as tmp:
        for setup in args.setups:
            raw[setup] = run_setup(setup, Path(tmp), 0.25 if args.quick else 1.0)
    report(raw, time.time() - started)
    return 0


def report(raw: dict, wall_s: float) -> None:
    keys = [slo_key(pair) for pair in SLOS]
    lines = [
        "# SLO planner vs fixed splits: a load shifting from prompt-heavy to decode-heavy",
        "",
        f"Phases (60 s each, `vllm bench serve` random): {json.dumps(PHASES)}. Planner: {json.dumps(AUTOSCALE)}. "
        "Attainment: share of requests with TTFT ≤ T and no inter-token gap > S.",
        "",
        "| setup | phase | " + " | ".join(keys) + " | TTFT p50 ms | failed | ready after (P, D) |",
        "|---|---|" + "---|" * len(keys) + "---|---|---|",
    ]
    for setup, phases in raw.items():
        for phase in PHASES:
            r = phases[phase]
            cells = " | ".join(f"{r['attainment'][k]:.2f}" for k in keys)
            after = r["replicas_after"]
            lines.append(
                f"| {setup} | {phase} | {cells} | {r['ttft_p50_ms'] or 0:.0f} | {r['failed']} | "
                f"{after['prefill']}, {after['decode']} |"
            )
    lines += ["", "Planner's last decision: " + json.dumps(raw.get("planner", {}).get("planner")), ""]
    lines.append(f"Wall time {wall_s:.0f} s. Machine: {json.dumps(machine())}")
    path = write_results("planner", {"raw": raw, "machine": machine()}, "\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
