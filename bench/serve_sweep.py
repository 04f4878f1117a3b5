"""Request-rate sweep of the serving benchmark: per-request SLO attainment and goodput against
offered load, per setup (the DistServe figure), on bench/serve.py's setups and workloads.

For each setup (started once) and workload, every stream of the workload runs at its rate times
each scale, with that many times the requests (the arrival window stays the same length), by
`vllm bench serve` (--save-detailed, --goodput). Per point: the attainment of the workload's
decode-side stream (bench/common.py SLOS: TTFT ≤ T and no inter-token gap > S), the tool's
goodput, failed requests, and the load generator's share of the CPU (it shares the 2 cores with
the servers), and why the requests that missed the first SLO pair missed it (TTFT, a gap, and how
many of those gaps fell between tokens 1 and 2). Every point holds at least --min-requests
decode-side requests (more requests, the same rates: a longer arrival window). The whole sweep
runs --repeats times, each repeat starting every setup afresh in a rotated order (the machine's
noise then falls on every setup alike); the report shows each point's median and spread. Per setup
and workload: the highest offered rate at which the median point has ≥ 90 % of requests meeting the
first SLO pair (the highest scale tried that met it), and that against aggregated's.

Writes bench/results/<date>-serve-sweep.{md,json} (the json with every request's TTFT and gaps)
and one attainment/goodput plot per workload; every setup's and load generator's logs stay in a
directory the report names.
Usage: python bench/serve_sweep.py [--setups pd aggregated ...] [--workloads interference steady]
       [--scales 0.5 1 2 3 4 6] [--repeats 3] [--min-requests 150] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    GOODPUT,
    HANDOFF_OVER,
    RESULTS,
    SLOS,
    attainment,
    machine,
    misses,
    percentile,
    requests,
    rotated,
    slo_key,
    write_results,
)
from bench.serve import (  # noqa: E402
    DIAGNOSTIC_SETUPS,
    SETUPS,
    WARM_UP_SEED,
    WORKLOADS,
    add_client_args,
    client_settings,
    quarter,
    run_workload,
    start_setup,
    warm_up,
)
from bench.serve_profile import cpu_profile, cpu_snapshot, profile, scrape  # noqa: E402
from bench.serve_report import fmt, handoff_cells, summarize  # noqa: E402
from bench.stalls import summary as stall_summary  # noqa: E402
from bench.stalls import table as stall_table  # noqa: E402

SCALES = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0)
STALL_PAIR = SLOS[1]  # (T 1000, S 50): the pair whose misses are stalls alone (bench/stalls.py)
ATTAINED = 0.9  # "meets the SLO" at a rate: this share of requests within the first SLO pair
POINT_SEED = 100  # seed offset per point of a setup's life; below WARM_UP_SEED for up to 9 scales
CLIENT = "vllm bench serve (client)"


def scaled(workload: dict, scale: float, quick: bool = False, min_requests: int = 0, point: int = 0) -> dict:
    """The workload's streams at `scale` times their rates and requests; all streams' requests
    multiplied alike until the decode-side one has `min_requests` (the same rates, a longer
    window); then a quarter of them for a --quick smoke run. `point`: which of a setup's points
    this is (its scale's index): each point asks its own prompts (seeds + POINT_SEED x point),
    since a prompt an earlier point sent would hit the prefix cache that point filled."""
    out = copy.deepcopy(workload)
    for stream in out["streams"].values():
        stream["rate"] = round(stream["rate"] * scale, 3)
        stream["prompts"] = max(4, round(stream["prompts"] * scale))
        stream["seed"] += POINT_SEED * point
    factor = math.ceil(min_requests / out["streams"][out["itl_stream"]]["prompts"])
    for stream in out["streams"].values():
        stream["prompts"] *= max(1, factor)
    return quarter(out) if quick else out


def offered(workload: dict) -> float:
    """Requests per second the workload offers, all streams together."""
    return round(sum(s["rate"] for s in workload["streams"].values()), 3)


def point(results: dict, workload: dict, cpu: dict) -> dict:
    decode_side = results[workload["itl_stream"]]
    total_cpu = sum(cpu["cpu_s"].values()) or 1.0
    per_request = requests(decode_side)
    return {
        "offered_rps": offered(workload),
        "attainment": attainment(decode_side),
        "misses": misses(per_request, SLOS[0]),
        "requests": per_request,
        "goodput_rps": decode_side.get("request_goodput"),
        "failed": sum(summarize(r)["failed"] for r in results.values()),
        "client_cpu_share": cpu["cpu_s"].get(CLIENT, 0.0) / total_cpu,
        # the decode-side client's own full GC pauses and stalls (bench/serve_client.py)
        "client_watch": decode_side.get("client_watch"),
        # the workload's other streams (interference: the long prompts, which take the P/D path
        # under the default cluster; the decode-side ones go to decode alone): the first-token
        # path's own requests
        "others": {
            stream: {"attainment": attainment(detailed), "requests": requests(detailed)}
            for stream, detailed in results.items()
            if stream != workload["itl_stream"]
        },
    }


def other_streams(runs: list[dict]) -> dict[str, dict]:
    """Per other stream of a point's repeats: median attainment, and over every request of every
    repeat: TTFT p50, token 1 -> 2 gap p50 / p99, when token 2 arrived p50 / p99 (ms); with the
    router's handoff gaps over 50 ms (every stream of the point; only these take the P/D path)."""
    out = {}
    for stream in runs[0].get("others", {}):
        done = [r for run in runs for r in run["others"][stream]["requests"] if r["ttft_ms"] is not None]
        ttfts = [r["ttft_ms"] for r in done]
        gaps = [r["gap_1_2_ms"] for r in done if r["gap_1_2_ms"] is not None]
        second = [r["ttft_ms"] + r["gap_1_2_ms"] for r in done if r["gap_1_2_ms"] is not None]
        keys = runs[0]["others"][stream]["attainment"]
        out[stream] = {
            "requests": sum(len(run["others"][stream]["requests"]) for run in runs),
            "attainment": {k: statistics.median(run["others"][stream]["attainment"][k] for run in runs) for k in keys},
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "gap_1_2_p50_ms": percentile(gaps, 0.5),
            "gap_1_2_p99_ms": percentile(gaps, 0.99),
            "token_2_p50_ms": percentile(second, 0.5),
            "token_2_p99_ms": percentile(second, 0.99),
            "router_handoff_gaps": sum((run.get("router") or {}).get("handoff_gaps") or 0 for run in runs),
            "router_handoff_gaps_over_50ms": sum((run.get("router") or {}).get(HANDOFF_OVER) or 0 for run in runs),
        }
    return out


def highest_attained(points: list[dict]) -> float | None:
    """The highest offered rate up to which every rate tried kept first-SLO-pair attainment
    ≥ ATTAINED (None: not even the lowest did)."""
    key, best = slo_key(SLOS[0]), None
    for p in sorted(points, key=lambda p: p["offered_rps"]):
        if p["attainment"][key] < ATTAINED:
            break
        best = p["offered_rps"]
    return best


def median_points(points: list[dict]) -> list[dict]:
    """One point per scale over the repeats: median attainment (and its min-max spread), median
    goodput and client CPU share, failed requests and misses summed."""
    by_scale: dict[float, list[dict]] = {}
    for p in points:
        by_scale.setdefault(p["scale"], []).append(p)
    out = []
    for scale, runs in sorted(by_scale.items()):
        keys = runs[0]["attainment"]
        goodputs = [r["goodput_rps"] for r in runs if r["goodput_rps"] is not None]
        out.append(
            {
                "scale": scale,
                "offered_rps": runs[0]["offered_rps"],
                "repeats": len(runs),
                "requests": sum(len(r["requests"]) for r in runs),
                "attainment": {k: statistics.median(r["attainment"][k] for r in runs) for k in keys},
                "spread": {
                    k: (min(r["attainment"][k] for r in runs), max(r["attainment"][k] for r in runs)) for k in keys
                },
                "goodput_rps": statistics.median(goodputs) if goodputs else None,
                "failed": sum(r["failed"] for r in runs),
                "client_cpu_share": statistics.median(r["client_cpu_share"] for r in runs),
                "misses": {k: sum(r["misses"][k] for r in runs) for k in runs[0]["misses"]},
                "others": other_streams(runs),
                "stalls": stall_summary(runs, slo_key(STALL_PAIR), STALL_PAIR[1]),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=[*SETUPS, *DIAGNOSTIC_SETUPS])
    parser.add_argument("--workloads", nargs="+", default=["interference", "steady"], choices=list(WORKLOADS))
    parser.add_argument("--scales", nargs="+", type=float, default=list(SCALES))
    parser.add_argument("--repeats", type=int, default=3, help="whole sweeps, setups in rotated order")
    parser.add_argument("--min-requests", type=int, default=150, help="decode-side requests per point, at least")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (smoke run)")
    parser.add_argument("--no-warm-up", action="store_true", help="measure from the setup's first request")
    add_client_args(parser)
    args = parser.parse_args(argv)
    if POINT_SEED * len(args.scales) > WARM_UP_SEED:
        parser.error(f"at most {WARM_UP_SEED // POINT_SEED} scales: later points would replay the warm-up's prompts")
    client_settings(args)
    raw: dict = {}
    notes: dict[str, str] = {}
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="pdcluster-sweep-"))  # kept: every setup's and client's logs
    print(f"logs: {logs}", flush=True)
    for repeat in range(args.repeats):
        for setup in rotated(args.setups, repeat):
            workdir = logs / f"repeat{repeat}-{setup}"
            workdir.mkdir()
            try:
                with start_setup(setup, workdir) as endpoint:
                    if not args.no_warm_up:  # each workload once at its lowest rate (bench/serve.py)
                        lowest = {n: scaled(WORKLOADS[n], min(args.scales)) for n in args.workloads}
                        warm_up(endpoint, lowest, workdir, setup)
                    for name in args.workloads:
                        for index, scale in enumerate(args.scales):
                            workload = scaled(WORKLOADS[name], scale, args.quick, args.min_requests, index)
                            before, cpu_before, t0 = scrape(endpoint), cpu_snapshot(), time.monotonic()
                            stolen = psutil.cpu_times().steal
                            results = run_workload(endpoint, workload, workdir, f"{setup}-{name}-{scale}")
                            wall = time.monotonic() - t0
                            cpu = cpu_profile(cpu_before, cpu_snapshot(), wall)
                            got = {"scale": scale, "repeat": repeat, **point(results, workload, cpu)}
                            # CPU time the hypervisor gave to others while this VM's cores wanted it
                            got["steal_share"] = (psutil.cpu_times().steal - stolen) / (wall * psutil.cpu_count())
                            # the router's view of the same point (every stream): where TTFT goes
                            got["router"] = profile(before, scrape(endpoint))
                            raw.setdefault(setup, {}).setdefault(name, []).append(got)
                            shown = {k: v for k, v in got.items() if k != "requests"}
                            print(setup, name, scale, json.dumps(shown), flush=True)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                notes[f"{setup}, repeat {repeat}"] = str(exc)[-2000:]
                print(f"{setup} failed in repeat {repeat}: {exc}", flush=True)
    report(raw, notes, args, time.time() - started, logs)
    return 0


def report(raw: dict, notes: dict, args, wall_s: float, logs: Path) -> None:
    date = time.strftime("%Y-%m-%d")
    keys = [slo_key(pair) for pair in SLOS]
    goodput = ", ".join(f"{k} ≤ {v} ms" for k, v in GOODPUT.items())
    lines = [
        f"# Serving benchmark: SLO attainment and goodput across request rates, {date}",
        "",
        f"Setups and workloads of bench/serve.py; each workload's streams at their rates × {args.scales}, "
        f"at least {args.min_requests} decode-side requests per point, {args.repeats} repeats (every setup "
        "started afresh in each, in rotated order). Attainment: share of the decode-side stream's requests "
        "with TTFT ≤ T and no inter-token gap > S, the median over the repeats [min-max]. Goodput: `vllm bench "
        f"serve --goodput` ({goodput}), requests/s, median. Misses (first pair, all repeats): failed / TTFT "
        "only / a gap only (of which the largest gap was between tokens 1 and 2) / both. The load generator "
        "shares the 2 cores: its median share of the CPU used is shown per point. Each setup first served a "
        "quarter of each workload at the lowest rate with other prompts, not measured"
        + (" (skipped in this run: --no-warm-up)." if args.no_warm_up else ".")
        + (f" The load generator ran at nice {args.client_nice}." if args.client_nice else "")
        + (" Its startup heap was frozen (bench/serve_client.py)." if args.client_freeze_heap else "")
        + (" The kernel's scheduler autogroups were off (--no-autogroups)." if args.no_autogroups else ""),
        "",
    ]
    medians = {setup: {name: median_points(points) for name, points in per.items()} for setup, per in raw.items()}
    for name in args.workloads:
        lines += [
            f"## {name}",
            "",
            "| setup | scale | offered req/s | requests | "
            + " | ".join(f"T {t} / S {s}" for t, s in SLOS)
            + " | goodput req/s | failed | misses f / ttft / gap (1→2) / both | client CPU |",
            "|---|---:|---:|---:|" + "---:|" * len(SLOS) + "---:|---:|---|---:|",
        ]
        best = {}
        for setup, per in medians.items():
            points = per.get(name, [])
            for p in points:
                cells = " | ".join(
                    f"{p['attainment'][k]:.2f} [{p['spread'][k][0]:.2f}-{p['spread'][k][1]:.2f}]" for k in keys
                )
                good = "-" if p["goodput_rps"] is None else f"{p['goodput_rps']:.2f}"
                m = p["misses"]
                lines.append(
                    f"| {setup} | {p['scale']:g} | {p['offered_rps']:g} | {p['requests']} | {cells} | {good} | "
                    f"{p['failed']} | {m['failed']} / {m['ttft']} / {m['gap']} ({m['gap_at_1_2']}) / {m['both']} | "
                    f"{100 * p['client_cpu_share']:.0f}% |"
                )
            best[setup] = highest_attained(points)
        base = best.get("aggregated")
        lines += [
            "",
            f"Highest offered rate with ≥ {ATTAINED:.0%} median attainment at T {SLOS[0][0]} / S {SLOS[0][1]} ms:",
            "",
        ]
        for setup, rate in best.items():
            ratio = f" ({rate / base:.2f}× aggregated)" if rate and base else ""
            lines.append(f"- {setup}: {'none of the rates tried' if rate is None else f'{rate:g} req/s'}{ratio}")
        lines.append("")
        lines += others_table(medians, name, keys)
        lines += handoff_table(raw, name)
        lines += ttft_table(raw, name)
        rows = [(setup, p["scale"], p["stalls"]) for setup, per in medians.items() for p in per.get(name, [])]
        lines += stall_table(rows, STALL_PAIR)
        png = RESULTS / f"{date}-serve-sweep-{name}.png"
        if any(per.get(name) for per in medians.values()):
            plot({setup: per.get(name, []) for setup, per in medians.items()}, name, keys[0], png)
            lines += [f"![{name}]({png.name})", ""]
    for setup, note in notes.items():
        lines += [f"**{setup} did not complete**: `{note[-400:]}`", ""]
    lines.append(f"Wall time {wall_s:.0f} s. Logs: `{logs}`. Machine: {json.dumps(machine())}")
    path = write_results("serve-sweep", {"raw": raw, "notes": notes, "args": vars(args), "machine": machine()},
                         "\n".join(lines) + "\n")  # fmt: skip
    print(path)


def others_table(medians: dict, name: str, keys: list[str]) -> list[str]:
    """The workload's other streams per setup and point (other_streams)."""
    rows = [
        (setup, p, stream, o)
        for setup, per in medians.items()
        for p in per.get(name, [])
        for stream, o in p.get("others", {}).items()
    ]
    if not rows:
        return []
    lines = [
        "The workload's other streams (interference: the long prompts, the ones that take the P/D path "
        "under the default cluster). Attainment as above (median over the repeats); the rest over every "
        "request of every repeat, ms; router: its handoff gaps (prefill's token → decode's first) over "
        "50 ms, of all it relayed at that point:",
        "",
        "| setup | scale | stream | requests | "
        + " | ".join(f"T {t} / S {s}" for t, s in SLOS)
        + " | TTFT p50 | gap 1→2 p50 / p99 | token 2 at p50 / p99 | router: handoff gaps > 50 ms |",
        "|---|---:|---|---:|" + "---:|" * len(SLOS) + "---:|---:|---:|---:|",
    ]
    for setup, p, stream, o in rows:
        cells = " | ".join(f"{o['attainment'][k]:.2f}" for k in keys)
        router = f"{o['router_handoff_gaps_over_50ms']:.0f} of {o['router_handoff_gaps']:.0f}"
        lines.append(
            f"| {setup} | {p['scale']:g} | {stream} | {o['requests']} | {cells} | {fmt(o['ttft_p50_ms'])} | "
            f"{fmt(o['gap_1_2_p50_ms'])} / {fmt(o['gap_1_2_p99_ms'])} | "
            f"{fmt(o['token_2_p50_ms'])} / {fmt(o['token_2_p99_ms'])} | {router} |"
        )
    return [*lines, ""]


def handoff_table(raw: dict, name: str) -> list[str]:
    """The P/D handoff's stages per repeat, from the cluster's metrics (means per pull, ms): one
    slow repeat shows here, where the pooled tables hide it."""
    rows = [
        (setup, run) for setup, per in raw.items() for run in per.get(name, []) if (run.get("router") or {}).get("kv_pull_mean_ms") is not None
    ]  # fmt: skip
    if not rows:
        return []
    lines = [
        "The handoff per repeat (cluster metrics, mean ms per pull): lease filed on prefill → pull starts on "
        "decode; the pull, and of it the pulling thread on a CPU / waiting for one (the rest: blocked); "
        "the share of pulls read out of prefill's cache without asking it (shm one-sided reads: ~1 on one "
        "node; 0 when decode fell back to the ring); bytes in → vLLM told (the engine's next step); the "
        "router's handoff gap (prefill's token → decode's first), and how many of those were over 50 ms:",
        "",
        "| setup | scale | repeat | lease filed → pull | pull | on a CPU / waiting | one-sided | bytes in → told | handoff gap | > 50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, run in rows:
        r = run["router"]
        over = f"{r.get(HANDOFF_OVER) or 0:.0f} of {r.get('handoff_gaps') or 0:.0f}"
        lines.append(f"| {setup} | {run['scale']:g} | {run['repeat']} | {' | '.join(handoff_cells(r))} | {over} |")
    return [*lines, ""]


def ttft_table(raw: dict, name: str) -> list[str]:
    """Where the first token's time went per repeat: the client's and the router's TTFT, the
    router's prefill phase (P/D path), and vLLM's own timings in the engine that computed the
    first token (prefill's on the P/D path, aggregated's otherwise; arrival at its front end ->
    first token, of it waiting in its queue and its scheduled steps). vLLM's queue time starts when
    the engine core takes the request, between steps: a request that arrives during another's step
    waits for that step first, and that wait is in neither column (pd's one prefill engine meets
    it where aggregated's two replicas take such requests side by side). What the engine did not see
    is compared over the same requests: the prefill phase less the prefill engine's TTFT (the
    hop: HTTP both ways, the front end's work before arrival, the router reading the answer), or
    for aggregated the router's TTFT less the engine's (the router's work and HTTP)."""
    rows = [
        (setup, run) for setup, per in raw.items() for run in per.get(name, []) if (run.get("router") or {}).get("engine_ms")
    ]  # fmt: skip
    if not rows:
        return []
    lines = [
        "Where TTFT went per repeat (means, ms, except the client's median): the router's TTFT (every request) "
        "and prefill phase (router -> prefill -> router, P/D path only); in the engine that computed the first "
        "token (prefill on the P/D path, else the aggregated replica), vLLM's own timings: arrival at its front "
        "end -> first token, of it queued and in scheduled steps (vLLM's queue time starts when the engine core "
        "takes the request, between steps: a request that arrives during another's step waits for that step "
        "first, in neither column); outside it, over the same requests: the prefill "
        "phase less the prefill engine's TTFT (pd: HTTP both ways, the front end's work before arrival, the router "
        "reading the answer), or the router's TTFT less the engine's (aggregated: the router's work and HTTP):",
        "",
        "| setup | scale | repeat | client TTFT p50 | router TTFT | prefill phase | engine | engine TTFT "
        "| queued | steps | outside the engine |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for setup, run in rows:
        r = run["router"]
        role = "prefill" if "prefill" in r["engine_ms"] else next(iter(r["engine_ms"]))
        e = r["engine_ms"][role]
        ttfts = [q["ttft_ms"] for q in run["requests"] if q["ttft_ms"] is not None]
        client = statistics.median(ttfts) if ttfts else None
        whole = r.get("prefill_phase_mean_ms") if role == "prefill" else r.get("router_ttft_mean_ms")
        outside = None if whole is None or e.get("ttft") is None else whole - e["ttft"]
        cells = [fmt(client), fmt(r.get("router_ttft_mean_ms")), fmt(r.get("prefill_phase_mean_ms")), role,
                 fmt(e.get("ttft")), fmt(e.get("queue")), fmt(e.get("prefill")), fmt(outside)]  # fmt: skip
        lines.append(f"| {setup} | {run['scale']:g} | {run['repeat']} | {' | '.join(cells)} |")
    return [*lines, ""]


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
