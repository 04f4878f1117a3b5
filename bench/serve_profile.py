"""What a serving run's cluster did, from its own counters: the router's TTFT, prefill phase and
handoff stages, the engines' own vLLM timings (authenticated /metrics, with the bench's secret),
and CPU-seconds per process role. bench/serve.py and bench/serve_sweep.py take a snapshot before
and after each point and report the differences."""

from __future__ import annotations

import os

import httpx

from bench.common import HANDOFF_BUDGET, HANDOFF_OVER, metric_samples, process_role

ROUTES = "pdcluster_route_decisions_total"
PROFILE_METRICS = (
    "pdcluster_itl_seconds",
    "pdcluster_prefill_seconds",
    "pdcluster_ttft_seconds",
    "pdcluster_kv_pull_seconds_total",
    "pdcluster_kv_pull_cpu_seconds_total",
    "pdcluster_kv_pull_runqueue_seconds_total",
    "pdcluster_kv_pulls_total",
    "pdcluster_kv_pulls_one_sided_total",
    "pdcluster_kv_lease_wait_seconds_total",
    "pdcluster_kv_load_report_seconds_total",
    "pdcluster_handoff_gap_seconds",
    ROUTES,
)


STALL_BUCKETS = ("0.08", "0.16")  # router ITL samples above these bucket bounds: stalls the router saw


# vLLM's own request timings, as each engine's front end records them: arrival -> first token,
# waiting in the scheduler's queue, and the scheduled steps up to the first token.
ENGINE_TIMINGS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
ENGINES: dict[str, tuple[str, list[tuple[str, str]]]] = {}  # endpoint -> (engine token, [(role, url)])


def engine_samples(endpoint: str) -> dict[str, float]:
    """The sums and counts of ENGINE_TIMINGS per role, from the engines of a pdcluster setup."""
    token, engines = ENGINES.get(endpoint, ("", []))
    values: dict[str, float] = {}
    wanted = {f"{metric}{end}": f"{key}{end}" for key, metric in ENGINE_TIMINGS.items() for end in ("_sum", "_count")}
    for role, url in engines:
        try:
            text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
        except httpx.HTTPError:
            continue
        for name, _, value in metric_samples(text):
            if name in wanted:
                key = f"engine[{role}]:{wanted[name]}"
                values[key] = values.get(key, 0.0) + value
    return values


def scrape(endpoint: str) -> dict[str, float]:
    """pdcluster router metrics relevant to the TTFT profile (sums and counts), and the engines'
    own timings (engine_samples)."""
    try:
        text = httpx.get(endpoint + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = engine_samples(endpoint)
    for name, labels, value in metric_samples(text):
        if name == "pdcluster_itl_seconds_bucket" and labels.get("le") in STALL_BUCKETS:
            values[f"itl_within_{labels['le']}"] = value
        if name == "pdcluster_handoff_gap_seconds_bucket" and labels.get("le") == HANDOFF_BUDGET:
            values["handoff_gap_within_budget"] = value
        if name.startswith(PROFILE_METRICS) and ("_sum" in name or "_count" in name or "total" in name):
            key = name + "".join(f"[{labels[k]}]" for k in ("replica", "outcome", "path") if k in labels)
            values[key] = values.get(key, 0.0) + value
    return values


def profile(before: dict, after: dict) -> dict:
    def delta(prefix: str) -> float:
        return sum(v for k, v in after.items() if k.startswith(prefix)) - sum(
            v for k, v in before.items() if k.startswith(prefix)
        )

    def mean(name: str) -> float | None:
        count = delta(f"{name}_count")
        return delta(f"{name}_sum") / count * 1e3 if count else None

    pulls = delta("pdcluster_kv_pulls_total")
    gaps = delta("pdcluster_itl_seconds_count")
    handoffs = delta("pdcluster_handoff_gap_seconds_count")

    def per_pull(name: str) -> float | None:
        return delta(name) / pulls * 1e3 if pulls else None

    return {
        "router_ttft_mean_ms": mean("pdcluster_ttft_seconds"),
        "prefill_phase_mean_ms": mean("pdcluster_prefill_seconds"),
        # the handoff, stage by stage: lease filed -> pull started -> bytes in -> vLLM told
        "kv_lease_wait_mean_ms": per_pull("pdcluster_kv_lease_wait_seconds_total"),
        "kv_pull_mean_ms": per_pull("pdcluster_kv_pull_seconds_total"),
        # of the pull: its thread on a CPU, and runnable but waiting for one (the rest: blocked)
        "kv_pull_cpu_mean_ms": per_pull("pdcluster_kv_pull_cpu_seconds_total"),
        "kv_pull_runqueue_mean_ms": per_pull("pdcluster_kv_pull_runqueue_seconds_total"),
        # pulls read out of the producer's cache without asking it (shm): ~1 on one node, 0 when a
        # consumer fell back to the ring or pulls ask the producer first
        "kv_one_sided_share": delta("pdcluster_kv_pulls_one_sided_total") / pulls if pulls else None,
        "kv_load_report_mean_ms": per_pull("pdcluster_kv_load_report_seconds_total"),
        # prefill's first token -> decode's first one, as the router relayed them
        "handoff_gap_mean_ms": mean("pdcluster_handoff_gap_seconds"),
        "handoff_gaps": handoffs,
        HANDOFF_OVER: handoffs - delta("handoff_gap_within_budget"),
        # gaps between the tokens the router relayed, over 80 and 160 ms: stalls upstream of the
        # client (decode engine or router), not in the client's own reading
        "router_itl_samples": gaps,
        **{f"router_itl_over_{float(le) * 1e3:.0f}ms": gaps - delta(f"itl_within_{le}") for le in STALL_BUCKETS},
        # per engine role, vLLM's own timings (ENGINE_TIMINGS): where the first token's time went
        # inside the engine that computed it, next to the router's view above
        "engine_ms": {
            role: {key: mean(f"engine[{role}]:{key}") for key in ENGINE_TIMINGS}
            for role in sorted({k[7:].split("]")[0] for k in after if k.startswith("engine[")})
        },
        # disaggregated requests by path (pd, local_prefill, local_queue, decode), as status counts them
        "routes": {
            key.removeprefix(ROUTES)[1:-1]: n for key in after if key.startswith(ROUTES + "[") if (n := delta(key))
        },
    }


# -- where the CPU goes -------------------------------------------------------------------


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    import psutil

    snap = {}
    for proc in psutil.process_iter():
        try:
            times = proc.cpu_times()
            if proc.pid == os.getpid():  # the `vllm bench serve` clients are our reaped children
                snap[proc.pid] = ("vllm bench serve (client)", times.children_user + times.children_system)
            else:
                snap[proc.pid] = (process_role(proc), times.user + times.system)
        except psutil.Error:
            continue
    return snap


def cpu_profile(before: dict, after: dict, wall_s: float) -> dict:
    """CPU-seconds per process role between two snapshots (processes that exited are missed)."""
    by_label: dict[str, float] = {}
    for pid, (label, cpu) in after.items():
        used = cpu - (before[pid][1] if pid in before else 0.0)
        if used > 0.05:
            by_label[label] = by_label.get(label, 0.0) + used
    return {"wall_s": wall_s, "cpu_s": dict(sorted(by_label.items(), key=lambda kv: -kv[1]))}
