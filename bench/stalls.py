"""Where a sweep point's stalls fell, and its attainment pooled over the repeats.

A stall of the decode engine holds back every stream it is serving at that moment, so one stall
makes several requests miss a gap bound S at once: requests are not independent trials, and a
median over three repeats of ~200 requests moves by a whole stall. Here the decode-side requests
whose largest gap exceeded S are grouped into stall events (their late gaps overlap in time, on
the clock every client shares: vllm bench serve's request start is time.perf_counter, Linux's
CLOCK_MONOTONIC), and each event is set against what the cluster was doing then, from the same
run's requests:

- a handoff: a long (P/D) request between its first token (the prefill's) and its second;
- a long prefill: a long request between its start and its first token;
- a local prefill: another decode-side request between its start and its first token (these
  short prompts are prefilled by decode itself, in the steps that also decode the others).

Beside each count, the share of the run's time such windows covered: what the count would be
if stalls fell at random moments.
"""

from __future__ import annotations

import math


def intervals(requests: list[dict], window: str) -> list[tuple[float, float]]:
    """Per request (bench/common.py requests(), with its times), the `window` ('prefill': start to
    first token; 'handoff': first token to second), seconds on the shared clock."""
    out = []
    for r in requests:
        if r.get("start_s") is None or r["ttft_ms"] is None:
            continue
        first = r["start_s"] + r["ttft_ms"] / 1e3
        if window == "prefill":
            out.append((r["start_s"], first))
        elif r["gap_1_2_ms"] is not None:
            out.append((first, first + r["gap_1_2_ms"] / 1e3))
    return out


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float, int]]:
    """Overlapping spans as one: (start, end, how many spans)."""
    out: list[list] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
            out[-1][2] += 1
        else:
            out.append([start, end, 1])
    return [tuple(x) for x in out]


def covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Share of [lo, hi] inside the union of spans."""
    inside = sum(min(e, hi) - max(s, lo) for s, e, _ in merged(spans) if e > lo and s < hi)
    return inside / (hi - lo) if hi > lo else 0.0


def overlaps(event: tuple[float, float, int], spans: list[tuple[float, float]]) -> bool:
    return any(s < event[1] and e > event[0] for s, e in spans)


def stall_events(decode_side: list[dict], long: list[dict], s_ms: float) -> dict:
    """One repeat's decode-side stalls over `s_ms`, as events, set against the cluster's work."""
    stalled = [
        (r["max_gap_end_s"] - r["max_gap_ms"] / 1e3, r["max_gap_end_s"])
        for r in decode_side
        if r.get("max_gap_end_s") is not None and (r["max_gap_ms"] or 0.0) > s_ms
    ]
    events = merged(stalled)
    hits = sum((r["max_gap_ms"] or 0.0) > s_ms for r in decode_side if r.get("max_gap_ms") is not None)
    timed = [r for r in [*decode_side, *long] if r.get("start_s") is not None and r["ttft_ms"] is not None]
    if not timed:  # results from before requests carried their times
        return {"events": 0, "hits": hits, "timed": False}
    lo = min(r["start_s"] for r in timed)
    # a request's last moment seen: its worst gap's end, or its first token where it had no gap
    hi = max(r.get("max_gap_end_s") or r["start_s"] + r["ttft_ms"] / 1e3 for r in timed)
    windows = {
        "handoff": intervals(long, "handoff"),
        "long_prefill": intervals(long, "prefill"),
        "local_prefill": intervals(decode_side, "prefill"),
    }
    out = {"events": len(events), "hits": hits, "timed": True, "seconds": hi - lo}
    for kind, spans in windows.items():
        out[kind] = sum(overlaps(e, spans) for e in events)
        out[f"{kind}_time_share"] = covered(spans, lo, hi)
    out["none"] = sum(not any(overlaps(e, spans) for spans in windows.values()) for e in events)
    out["none_time_share"] = 1.0 - covered([s for spans in windows.values() for s in spans], lo, hi)
    out["longest_ms"] = max((1e3 * (e[1] - e[0]) for e in events), default=0.0)
    return out


def pooled_attainment(runs: list[dict], key: str) -> dict:
    """The decode-side attainment at SLO pair `key` over every request of every repeat, with its
    Wilson 95 % interval (which, stalls hitting several requests at once, is if anything narrow)."""
    n = sum(len(run["requests"]) for run in runs)
    if not n or any(key not in run["attainment"] for run in runs):
        return {"requests": 0, "share": None, "low": None, "high": None}
    met = sum(run["attainment"][key] * len(run["requests"]) for run in runs)
    p, z = met / n, 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {"requests": n, "met": round(met), "share": p, "low": centre - half, "high": centre + half}


def summary(runs: list[dict], key: str, s_ms: float) -> dict:
    """A point's repeats: pooled attainment at `key`, and their stall events over `s_ms` summed."""
    per_repeat = [
        stall_events(run["requests"], run.get("others", {}).get("long", {}).get("requests", []), s_ms) for run in runs
    ]
    out = {"pooled": pooled_attainment(runs, key), "timed": all(e["timed"] for e in per_repeat)}
    for field in ("events", "hits", "handoff", "long_prefill", "local_prefill", "none"):
        out[field] = sum(e.get(field, 0) for e in per_repeat)
    seconds = sum(e.get("seconds", 0.0) for e in per_repeat)
    out["seconds"] = seconds
    for kind in ("handoff", "long_prefill", "local_prefill", "none"):
        # time-weighted over the repeats
        share = sum(e.get(f"{kind}_time_share", 0.0) * e.get("seconds", 0.0) for e in per_repeat)
        out[f"{kind}_time_share"] = share / seconds if seconds else None
    out["longest_ms"] = max((e.get("longest_ms", 0.0) for e in per_repeat), default=0.0)
    return out


def table(rows: list[tuple[str, float, dict]], pair: tuple[int, int]) -> list[str]:
    """The report's lines for (setup, scale, summary()) rows."""
    if not rows:
        return []
    t_ms, s_ms = pair
    lines = [
        f"Decode-side stream, every repeat pooled: attainment at T {t_ms} / S {s_ms} ms over all its "
        "requests [Wilson 95 % interval]; its stalls over S grouped into events (late gaps that overlap "
        "in time: one engine stall, several streams), and how many events overlapped a handoff (a long "
        "request's token 1 → 2), a long prefill (its start → token 1) or a local prefill on decode (a "
        "decode-side request's start → token 1), each with the share of the run's time such windows "
        "covered (bench/stalls.py):",
        "",
        "| setup | scale | requests | pooled attainment | stall events | requests hit | longest ms | "
        "at a handoff | in a long prefill | in a local prefill | in none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, scale, s in rows:
        p = s["pooled"]
        share = "-" if p["share"] is None else f"{p['share']:.3f} [{p['low']:.3f}-{p['high']:.3f}]"
        at = " | ".join(during(s, kind) for kind in ("handoff", "long_prefill", "local_prefill", "none"))
        events, longest = (s["events"], f"{s['longest_ms']:.0f}") if s["timed"] else ("-", "-")
        lines.append(f"| {setup} | {scale:g} | {p['requests']} | {share} | {events} | {s['hits']} | {longest} | {at} |")
    return [*lines, ""]


def during(s: dict, kind: str) -> str:
    """A table cell: events that overlapped `kind` windows, and how much of the time those covered."""
    if not s["timed"]:
        return "-"
    return f"{s[kind]} ({100 * (s[f'{kind}_time_share'] or 0.0):.0f}% of time)"
