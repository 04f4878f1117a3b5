"""Request-rate sweep of the serving benchmark: per-request SLO attainment and goodput against
offered load, per setup (the DistServe figure), on bench/serve.py's setups and workloads.

For each setup (started once) and workload, every stream of the workload runs at its rate times
each scale, with that many times the requests (the arrival window stays the same length), by
`vllm bench serve` (--save-detailed, --goodput). Per point: the attainment of the workload's
decode-side stream (bench/common.py SLOS: TTFT ≤ T and no inter-token gap > S), the tool's
goodput, failed requests, and the load generator's share of the CPU (it shares the 2 cores with
the servers). Per setup and workload: the highest offered rate at which ≥ 90 % of requests meet
the first SLO pair (the highest scale tried that met it), and that against aggregated's.

Writes bench/results/<date>-serve-sweep.{md,json} and one attainment/goodput plot per workload.
Usage: python bench/serve_sweep.py [--setups pd aggregated ...] [--workloads interference steady]
       [--scales 0.5 1 2 3 4 6] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import GOODPUT, RESULTS, SLOS, attainment, machine, slo_key, write_results  # noqa: E402
from bench.serve import (  # noqa: E402
    DIAGNOSTIC_SETUPS,
    SETUPS,
    WORKLOADS,
    cpu_profile,
    cpu_snapshot,
    run_workload,
    start_setup,
    warm_up,
)
from bench.serve_report import summarize  # noqa: E402

SCALES = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0)
ATTAINED = 0.9  # "meets the SLO" at a rate: this share of requests within the first SLO pair
CLIENT = "vllm bench serve (client)"


def scaled(workload: dict, scale: float, quick: bool) -> dict:
    out = copy.deepcopy(workload)
    for stream in out["streams"].values():
        stream["rate"] = round(stream["rate"] * scale, 3)
        stream["prompts"] = max(4, round(stream["prompts"] * scale / (4 if quick else 1)))
    return out


def offered(workload: dict) -> float:
    """Requests per second the workload offers, all streams together."""
    return round(sum(s["rate"] for s in workload["streams"].values()), 3)


def point(results: dict, workload: dict, cpu: dict) -> dict:
    decode_side = results[workload["itl_stream"]]
    total_cpu = sum(cpu["cpu_s"].values()) or 1.0
    return {
        "offered_rps": offered(workload),
        "attainment": attainment(decode_side),
        "goodput_rps": decode_side.get("request_goodput"),
        "failed": sum(summarize(r)["failed"] for r in results.values()),
        "client_cpu_share": cpu["cpu_s"].get(CLIENT, 0.0) / total_cpu,
    }


def highest_attained(points: list[dict]) -> float | None:
    """The highest offered rate up to which every rate tried kept first-SLO-pair attainment
    ≥ ATTAINED (None: not even the lowest did)."""
    key, best = slo_key(SLOS[0]), None
    for p in sorted(points, key=lambda p: p["offered_rps"]):
        if p["attainment"][key] < ATTAINED:
            break
        best = p["offered_rps"]
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=[*SETUPS, *DIAGNOSTIC_SETUPS])
    parser.add_argument("--workloads", nargs="+", default=["interference", "steady"], choices=list(WORKLOADS))
    parser.add_argument("--scales", nargs="+", type=float, default=list(SCALES))
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (smoke run)")
    parser.add_argument("--no-warm-up", action="store_true", help="measure from the setup's first request")
    args = parser.parse_args(argv)
    raw: dict = {}
    notes: dict[str, str] = {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pdcluster-sweep-") as tmp:
        workdir = Path(tmp)
        for setup in args.setups:
            try:
                with start_setup(setup, workdir) as endpoint:
                    if not args.no_warm_up:  # each workload once at its lowest rate (bench/serve.py)
                        warm_up(
                            endpoint,
                            {n: scaled(WORKLOADS[n], min(args.scales), False) for n in args.workloads},
                            workdir,
                            setup,
                        )
                    for name in args.workloads:
                        for scale in args.scales:
                            workload = scaled(WORKLOADS[name], scale, args.quick)
                            cpu_before, t0 = cpu_snapshot(), time.monotonic()
                            results = run_workload(endpoint, workload, workdir, f"{setup}-{name}-{scale}")
                            cpu = cpu_profile(cpu_before, cpu_snapshot(), time.monotonic() - t0)
                            got = point(results, workload, cpu)
                            raw.setdefault(setup, {}).setdefault(name, []).append({"scale": scale, **got})
                            print(setup, name, scale, json.dumps(got), flush=True)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                notes[setup] = str(exc)[-2000:]
                print(f"{setup} failed: {exc}", flush=True)
    report(raw, notes, args, time.time() - started)
    return 0


def report(raw: dict, notes: dict, args, wall_s: float) -> None:
    date = time.strftime("%Y-%m-%d")
    keys = [slo_key(pair) for pair in SLOS]
    goodput = ", ".join(f"{k} ≤ {v} ms" for k, v in GOODPUT.items())
    lines = [
        f"# Serving benchmark: SLO attainment and goodput across request rates, {date}",
        "",
        f"Setups and workloads of bench/serve.py; each workload's streams at their rates × {args.scales} "
        "(requests scaled alike). Attainment: share of the decode-side stream's requests with TTFT ≤ T and no "
        f"inter-token gap > S. Goodput: `vllm bench serve --goodput` ({goodput}), requests/s. The load generator "
        "shares the 2 cores: its share of the CPU used is shown per point. Each setup first served a quarter "
        "of each workload at the lowest rate with other prompts, not measured"
        + (" (skipped in this run: --no-warm-up)." if args.no_warm_up else "."),
        "",
    ]
    for name in args.workloads:
        lines += [
            f"## {name}",
            "",
            "| setup | scale | offered req/s | "
            + " | ".join(f"T {t} / S {s}" for t, s in SLOS)
            + " | goodput req/s | failed | client CPU |",
            "|---|---:|---:|" + "---:|" * len(SLOS) + "---:|---:|---:|",
        ]
        best = {}
        for setup, per in raw.items():
            points = per.get(name, [])
            for p in points:
                cells = " | ".join(f"{p['attainment'][k]:.2f}" for k in keys)
                good = "-" if p["goodput_rps"] is None else f"{p['goodput_rps']:.2f}"
                lines.append(
                    f"| {setup} | {p['scale']:g} | {p['offered_rps']:g} | {cells} | {good} | {p['failed']} | "
                    f"{100 * p['client_cpu_share']:.0f}% |"
                )
            best[setup] = highest_attained(points)
        base = best.get("aggregated")
        lines += [
            "",
            f"Highest offered rate with ≥ {ATTAINED:.0%} attainment at T {SLOS[0][0]} / S {SLOS[0][1]} ms:",
            "",
        ]
        for setup, rate in best.items():
            ratio = f" ({rate / base:.2f}× aggregated)" if rate and base else ""
            lines.append(f"- {setup}: {'none of the rates tried' if rate is None else f'{rate:g} req/s'}{ratio}")
        lines.append("")
        png = RESULTS / f"{date}-serve-sweep-{name}.png"
        if any(per.get(name) for per in raw.values()):
            plot({setup: per.get(name, []) for setup, per in raw.items()}, name, keys[0], png)
            lines += [f"![{name}]({png.name})", ""]
    for setup, note in notes.items():
        lines += [f"**{setup} did not complete**: `{note[-400:]}`", ""]
    lines.append(f"Wall time {wall_s:.0f} s. Machine: {json.dumps(machine())}")
    path = write_results("serve-sweep", {"raw": raw, "notes": notes, "args": vars(args), "machine": machine()},
                         "\n".join(lines) + "\n")  # fmt: skip
    print(path)


def plot(series: dict[str, list[dict]], workload: str, key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setup, points in series.items():
        if not points:
            continue
        rates = [p["offered_rps"] for p in points]
        left.plot(rates, [p["attainment"][key] for p in points], marker="o", label=setup)
        right.plot(rates, [p["goodput_rps"] or 0.0 for p in points], marker="o", label=setup)
    left.axhline(ATTAINED, color="grey", linestyle="--", linewidth=0.8)
    for ax, title in ((left, f"SLO attainment ({key})"), (right, "goodput (req/s)")):
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(f"{title} — {workload}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
