"""The serving benchmark's report (bench/serve.py runs it): per setup and workload the numbers
`vllm bench serve` computed, the ITL tail beyond p99, TTFT/ITL CDF plots and the verdicts
against the README's targets. Writes bench/results/<date>-serve.{md,json} and the plots."""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import GOODPUT, HANDOFF_OVER, RESULTS, SLOS, attainment, machine, slo_key, write_results


def summarize(result: dict) -> dict:
    def get(key):
        return result.get(key)

    return {
        "completed": get("completed"),
        "failed": get(
            "failed",
        )
        if get("failed") is not None
        else len([e for e in result.get("errors", []) if e]),
        "ttft_p50_ms": get("p50_ttft_ms"),
        "ttft_p99_ms": get("p99_ttft_ms"),
        "itl_p50_ms": get("p50_itl_ms"),
        "itl_p99_ms": get("p99_itl_ms"),
        "tpot_mean_ms": get("mean_tpot_ms"),
        "output_tok_s": get("output_throughput"),
    }


def pooled_itls(result: dict) -> list[float]:
    """Every request's ITL gaps in one list (seconds), as `vllm bench serve` pools them."""
    return [x for per_req in result.get("itls", []) for x in per_req]


STALL_MS = 100.0  # an ITL gap this long is a stall: far beyond a decode step, shorter than a long prefill


def tail_shape(itls_s: list[float]) -> dict:
    """Beyond p99: the ITL stream's upper percentiles and its stalls, from vLLM's raw samples
    (seconds, every request's gaps pooled as `vllm bench serve` pools them for its p99)."""
    import numpy as np

    if not itls_s:
        return {}
    ms = np.asarray(itls_s) * 1e3
    p99, p995, p999 = np.percentile(ms, [99, 99.5, 99.9])
    stalls = int((ms > STALL_MS).sum())
    return {
        "samples": int(ms.size),
        "itl_p99_ms": float(p99),
        "itl_p995_ms": float(p995),
        "itl_p999_ms": float(p999),
        "itl_max_ms": float(ms.max()),
        "stalls": stalls,
        "stall_share": stalls / ms.size,
    }


def plot(samples: dict, workload: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for setup, (ttfts, itls) in samples.items():
        for ax, values in ((axes[0], ttfts), (axes[1], itls)):
            if not values:
                continue
            ordered = sorted(v * 1e3 for v in values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=setup)
    for ax, title in ((axes[0], "TTFT"), (axes[1], "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{title} — {workload}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attainment_table(raw: dict, workload: str, stream: str) -> list[str]:
    """Per setup, the share of the stream's requests meeting each SLO pair (TTFT and largest
    inter-token gap, bench/common.py SLOS), and `vllm bench serve`'s own goodput where it ran
    with --goodput (requests/s meeting GOODPUT)."""
    keys = [slo_key(pair) for pair in SLOS]
    goodput = ", ".join(f"{k} ≤ {v} ms" for k, v in GOODPUT.items())
    lines = [
        "",
        f"SLO attainment of the `{stream}` stream (share of its requests with TTFT ≤ T and no gap > S; "
        f"goodput: requests/s with {goodput}):",
        "",
        "| setup | " + " | ".join(f"T {t} / S {s} ms" for t, s in SLOS) + " | goodput req/s |",
        "|---|" + "---:|" * (len(SLOS) + 1),
    ]
    for setup, per in raw.items():
        result = per.get(workload, {}).get("results", {}).get(stream)
        if result is None:
            continue
        shares = attainment(result)
        cells = " | ".join(f"{shares[k]:.2f}" for k in keys)
        lines.append(f"| {setup} | {cells} | {fmt(result.get('request_goodput'))} |")
    return lines


def report(raw: dict, notes: dict, workloads: dict, args, engine_args: dict, max_model_len: int) -> None:
    date = time.strftime("%Y-%m-%d")
    lines = [
        f"# Serving benchmark, {date}",
        "",
        "Same machine (2 cores), same model (tiny, no MTP), same engine settings "
        f"({', '.join(f'{k}={v}' for k, v in engine_args.items())}, max_model_len={max_model_len}) for every setup. "
        "Numbers computed by `vllm bench serve` (random dataset, Poisson arrivals, ignore_eos).",
        "ITL is the gap between SSE chunks as the client reads them: on 2 busy cores several tokens often "
        "arrive in one read, hence ITL p50 near 0 ms; p99 is the stall a user sees.",
        "`pd` streams the prefill's first token at once and decode continues after it "
        "(`router.first_token_from_prefill`, the default); `pd-classic` is the same cluster with it off "
        "(decode samples the first token after the handoff, as in vLLM's own P/D).",
        "Each setup first served a quarter of each workload with other prompts, not measured"
        + (" (skipped in this run: --no-warm-up)." if getattr(args, "no_warm_up", False) else "."),
        "",
    ]
    for name, workload in workloads.items():
        streams = ", ".join(
            f"{s}: {p['prompts']} x {p['input_len']} in / {p['output_len']} out at {p['rate']} req/s"
            for s, p in workload["streams"].items()
        )
        lines += [
            f"## {name}",
            "",
            f"Streams (run concurrently): {streams}.",
            "",
            "| setup | stream | done | failed | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT mean | out tok/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        samples = {}
        for setup, per in raw.items():
            if name not in per:
                continue
            ttfts, itls = [], []
            for stream, result in per[name]["results"].items():
                s = summarize(result)
                lines.append(
                    f"| {setup} | {stream} | {s['completed']} | {s['failed']} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p99_ms'])} | "
                    f"{fmt(s['itl_p50_ms'])} | {fmt(s['itl_p99_ms'])} | {fmt(s['tpot_mean_ms'])} | {fmt(s['output_tok_s'])} |"
                )
                ttfts += [t for t in result.get("ttfts", []) if t]
                if stream == workload["itl_stream"]:
                    itls += pooled_itls(result)
            samples[setup] = (ttfts, itls)
        lines += attainment_table(raw, name, workload["itl_stream"])
        shapes = {setup: tail_shape(itls) for setup, (_, itls) in samples.items() if itls}
        if shapes:
            lines += [
                "",
                f"Tail of the `{workload['itl_stream']}` stream's ITL (all its gaps pooled; "
                f"stall: a gap over {STALL_MS:.0f} ms):",
                "",
                "| setup | gaps | ITL p99 | p99.5 | p99.9 | max | stalls | stall share |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for setup, t in shapes.items():
                lines.append(
                    f"| {setup} | {t['samples']} | {fmt(t['itl_p99_ms'])} | {fmt(t['itl_p995_ms'])} | {fmt(t['itl_p999_ms'])} | "
                    f"{fmt(t['itl_max_ms'])} | {t['stalls']} | {100 * t['stall_share']:.2f}% |"
                )
        png = RESULTS / f"{date}-serve-{name}.png"
        RESULTS.mkdir(parents=True, exist_ok=True)
        if samples:
            plot(samples, name, png)
            lines += ["", f"![{name} CDFs]({png.name})", ""]
        profiles = {
            setup: per[name]["profile"]
            for setup, per in raw.items()
            if name in per and any(per[name]["profile"].values())
        }
        if profiles:
            lines += [
                "Where TTFT and the handoff go (pdcluster metrics, means over the run, ms; the handoff gap "
                "is the prefill's first token -> decode's first, as the router relayed them):",
                "",
            ]
            lines += [
                "| setup | router TTFT | prefill phase (router -> P -> router) | lease filed -> pull (on D) "
                "| KV pull (on D) | of it on a CPU / waiting for one | read one-sided | bytes in -> vLLM told "
                "| handoff gap | handoff gaps > 50 ms |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for setup, p in profiles.items():
                over = p.get(HANDOFF_OVER)
                cells = [fmt(p.get("router_ttft_mean_ms")), fmt(p.get("prefill_phase_mean_ms")), *handoff_cells(p)]
                gaps = f"{over:.0f} of {p['handoff_gaps']:.0f}" if p.get("handoff_gaps") else "-"
                lines.append(f"| {setup} | {' | '.join(cells)} | {gaps} |")
            lines.append("")
    lines += [
        "## Where the CPU went",
        "",
        "CPU-seconds per process role during each workload (2 cores: at most 2 CPU-seconds per wall second).",
        "",
    ]
    for setup, per in raw.items():
        for name in workloads:
            cpu = per.get(name, {}).get("cpu")
            if cpu:
                parts = ", ".join(f"{label} {sec:.0f}" for label, sec in cpu["cpu_s"].items())
                total = sum(cpu["cpu_s"].values())
                lines.append(f"- {setup} / {name} ({cpu['wall_s']:.0f} s wall, {total:.0f} CPU-s): {parts}")
    lines += ["", "## Targets", ""] + verdicts(raw, workloads)
    for setup, note in notes.items():
        lines += ["", f"**{setup} could not run**: ```{note}```"]
    write_results(
        "serve",
        {"machine": machine(), "args": vars(args), "workloads": workloads, "raw": raw, "notes": notes},
        "\n".join(lines) + "\n",
    )


def metric(raw, setup, workload, stream, key):
    try:
        return summarize(raw[setup][workload]["results"][stream])[key]
    except KeyError:
        return None


def stream_tail(raw, setup, workload, stream) -> dict:
    try:
        result = raw[setup][workload]["results"][stream]
    except KeyError:
        return {}
    return tail_shape(pooled_itls(result))


def verdicts(raw: dict, workloads: dict) -> list[str]:
    out = []

    def check(label, ours, theirs, bound):
        if ours is None or theirs is None:
            out.append(f"- {label}: not measured")
            return
        ratio = ours / theirs
        out.append(
            f"- {label}: {ours:.1f} / {theirs:.1f} ms = **{ratio:.2f}x** (target ≤ {bound}x) — {'met' if ratio <= bound else 'MISSED'}"
        )

    if "interference" in workloads:
        check(
            "interference, P/D p99 ITL vs aggregated",
            metric(raw, "pd", "interference", "decode", "itl_p99_ms"),
            metric(raw, "aggregated", "interference", "decode", "itl_p99_ms"),
            0.5,
        )
    if "steady" in workloads:
        check(
            "steady, P/D TTFT p50 vs aggregated",
            metric(raw, "pd", "steady", "short", "ttft_p50_ms"),
            metric(raw, "aggregated", "steady", "short", "ttft_p50_ms"),
            1.2,
        )
        check(
            "steady, P/D TTFT p50 vs vLLM P/D",
            metric(raw, "pd", "steady", "short", "ttft_p50_ms"),
            metric(raw, "vllm-pd", "steady", "short", "ttft_p50_ms"),
            1.0,
        )
    if "interference" in workloads:
        check(
            "interference, P/D ITL p99 vs vLLM P/D",
            metric(raw, "pd", "interference", "decode", "itl_p99_ms"),
            metric(raw, "vllm-pd", "interference", "decode", "itl_p99_ms"),
            1.0,
        )
        ours, agg = (
            stream_tail(raw, "pd", "interference", "decode"),
            stream_tail(raw, "aggregated", "interference", "decode"),
        )
        if ours and agg:
            out.append(
                f"- (diagnostic) interference, P/D ITL p99.9 vs aggregated: {ours['itl_p999_ms']:.1f} / {agg['itl_p999_ms']:.1f} ms = "
                f"{ours['itl_p999_ms'] / agg['itl_p999_ms']:.2f}x; gaps over {STALL_MS:.0f} ms: {ours['stall_share']:.2%} of P/D's vs "
                f"{agg['stall_share']:.2%} of aggregated's (a p99 shows stalls only once they pass 1% of the gaps)"
            )
    for name, stream, key in (
        ("steady", "short", "ttft_p50_ms"),
        ("steady", "short", "itl_p99_ms"),
        ("interference", "decode", "itl_p99_ms"),
    ):
        ours, classic = metric(raw, "pd", name, stream, key), metric(raw, "pd-classic", name, stream, key)
        if name in workloads and ours is not None and classic is not None:
            out.append(
                f"- (diagnostic) {name}, P/D {key} with the first token from the prefill vs without (pd-classic): {ours:.1f} / {classic:.1f} ms = {ours / classic:.2f}x"
            )
    if "light" in workloads:
        for other in ("aggregated", "vllm-pd"):
            ours, theirs = (
                metric(raw, "pd", "light", "short", "ttft_p50_ms"),
                metric(raw, other, "light", "short", "ttft_p50_ms"),
            )
            if ours is not None and theirs is not None:
                out.append(
                    f"- (diagnostic) light load, P/D TTFT p50 vs {other}: {ours:.1f} / {theirs:.1f} ms = {ours / theirs:.2f}x"
                )
    failed = {
        f"{setup}/{w}": sum(summarize(r)["failed"] or 0 for r in per[w]["results"].values())
        for setup, per in raw.items()
        for w in per
    }
    ours = {k: v for k, v in failed.items() if not k.startswith("vllm-pd/")}
    baseline = {k: v for k, v in failed.items() if k.startswith("vllm-pd/")}
    out.append(f"- failed requests, pdcluster setups: {ours} — {'met' if not any(ours.values()) else 'MISSED'}")
    if baseline:
        out.append(f"- (baseline) failed requests, vLLM's own P/D: {baseline}")
    return out


def handoff_cells(p: dict) -> list[str]:
    """A profile's handoff stages as table cells (bench/serve.profile, ms): lease filed -> pull,
    the pull, its thread on a CPU / waiting for one, the share of pulls read one-sided, bytes in
    -> vLLM told, the handoff gap."""
    split = f"{fmt(p.get('kv_pull_cpu_mean_ms'))} / {fmt(p.get('kv_pull_runqueue_mean_ms'))}"
    one_sided = p.get("kv_one_sided_share")
    return [
        fmt(p.get("kv_lease_wait_mean_ms")),
        fmt(p.get("kv_pull_mean_ms")),
        split,
        "-" if one_sided is None else f"{one_sided:.2f}",
        fmt(p.get("kv_load_report_mean_ms")),
        fmt(p.get("handoff_gap_mean_ms")),
    ]


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"
