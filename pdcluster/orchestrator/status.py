"""One replica's row of `pdcluster status` (what `status --json` prints, and the table is made of):
the controller's view of it (role, node, state, stage, error), the router's (in flight, TTFT/ITL
over the last minute) and its engine's (running, waiting, KV usage, KV backends, MTP counters);
and the table `pdcluster status` prints from the whole status (`format_status`); what `status
--watch` prints (`watched`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pdcluster.errors import PDClusterError


def replica_row(replica, latency: dict[str, Any], inflight: dict[str, int], kv_backend: str) -> dict[str, Any]:
    """`replica`: the controller's Replica; `latency`/`inflight`: the router's, by replica id."""
    info = replica.info or {}
    stats = info.get("stats") or {}
    lat = latency.get(replica.replica_id, {})
    return {
        "replica": replica.replica_id,
        "role": replica.role,
        "node": replica.node,
        "pid": info.get("pid"),  # its actor's process on that node (engine processes are below it)
        "state": replica.state.label,
        "stage": replica.stage,
        "url": replica.url,
        "error": replica.error,
        "inflight": inflight.get(replica.replica_id, 0),
        "running": stats.get("running", 0),
        "waiting": stats.get("waiting", 0),
        "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
        "ttft_p50": (lat.get("ttft") or {}).get("p50"),
        "ttft_p99": (lat.get("ttft") or {}).get("p99"),
        "itl_p50": (lat.get("itl") or {}).get("p50"),
        "itl_p99": (lat.get("itl") or {}).get("p99"),
        "prefill_p50": (lat.get("phase") or {}).get("p50"),
        "prefill_p99": (lat.get("phase") or {}).get("p99"),
        "async_scheduling": info.get("async_scheduling"),
        "async_scheduling_reason": info.get("async_scheduling_reason", ""),
        "single_process": info.get("single_process"),
        "single_process_reason": info.get("single_process_reason", ""),
        "replica_cores": info.get("replica_cores"),
        "kv_backend": kv_backend if replica.role != "aggregated" else None,
        # decode: the backend used with each prefill engine it pulled from
        "kv_backends": stats.get("kv_backends") or {},
        "rss_bytes": info.get("rss_bytes"),
        "stats": stats,
        "transitions": replica.transitions,
    }


def retired_row(replica) -> dict[str, Any]:
    """A replica the controller stopped or replaced: its states, and why it ended."""
    return {
        "replica": replica.replica_id,
        "role": replica.role,
        "transitions": replica.transitions,
        "error": replica.error,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"cluster {status['name']}  mode {status['mode']}  model {status['model']}  endpoint {status['endpoint']}",
        "",
        f"{'REPLICA':<14}{'ROLE':<11}{'NODE':<16}{'STATE':<10}{'INFL':>5}{'RUN':>5}{'WAIT':>5}{'KV%':>6}"
        f"{'TTFT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}  NOTES",
    ]
    for r in status["replicas"]:
        if r["role"] == "prefill":
            ttft = f"{_ms(r['prefill_p50'])}/{_ms(r['prefill_p99'])}"
            itl = "-"
        else:
            ttft = f"{_ms(r['ttft_p50'])}/{_ms(r['ttft_p99'])}"
            itl = f"{_ms(r['itl_p50'])}/{_ms(r['itl_p99'])}"
        notes = []
        if r["state"] == "starting":
            notes.append(r["stage"])
        if r["error"]:
            notes.append(r["error"])
        if r["role"] != "prefill" and r["async_scheduling"] is False and r["async_scheduling_reason"]:
            notes.append(f"async scheduling off ({r['async_scheduling_reason']})")
        if r.get("single_process_reason"):
            notes.append(f"worker process kept ({r['single_process_reason']})")
        stats = r.get("stats") or {}
        if stats.get("spec_acceptance_rate") is not None:
            notes.append(
                f"MTP acceptance {stats['spec_acceptance_rate']:.2f}, "
                f"{stats['spec_mean_accepted_length']:.2f} tok/round "
                f"({stats['spec_accepted_tokens']}/{stats['spec_draft_tokens']} drafts)"
            )
        if stats.get("prefix_cache_queries"):
            notes.append(f"prefix hits {stats['prefix_cache_hits'] / stats['prefix_cache_queries']:.2f}")
        if stats.get("kv_pull_failures"):
            causes = ", ".join(f"{cause} {n}" for cause, n in sorted(stats["kv_pull_failures"].items()))
            notes.append(f"failed pulls: {causes}")
        if r.get("kv_backend"):
            pairs = ", ".join(f"{peer}→{b}" for peer, b in sorted((r.get("kv_backends") or {}).items()))
            notes.append(f"kv {r['kv_backend']}" + (f": {pairs}" if pairs else ""))
        lines.append(
            f"{r['replica']:<14}{r['role']:<11}{(r['node'] or '-'):<16}{r['state']:<10}{r['inflight']:>5}"
            f"{r['running']:>5}{r['waiting']:>5}{r['kv_cache_usage'] * 100:>6.1f}{ttft:>17}{itl:>16}  {'; '.join(notes)}"
        )
    if status.get("router_error"):
        lines.append(f"router: {status['router_error']}")
    elif status.get("router_restarts"):
        lines.append(f"router: restarted {status['router_restarts']} time(s) (it died or hung)")
    if status.get("controller_restarts"):
        restarts = status["controller_restarts"]
        lines.append(f"controller: restarted {restarts} time(s) (it died; the router and the replicas served on)")
    routes = status.get("routes") or {}
    if routes:
        lines.append("routes: " + ", ".join(f"{path} {count}" for path, count in sorted(routes.items())))
    cache = status.get("cache") or {}
    if cache.get("policy") == "cache_aware":
        known = ", ".join(
            f"{rid} {c['source']} ({c['blocks'] if c['source'] == 'events' else c['history']} blocks)"
            for rid, c in sorted(cache["replicas"].items())
        )
        lines.append(f"cache-aware routing: {known or 'no replica followed yet'}")
    planner = status.get("planner")
    if planner:
        wanted = ", ".join(f"{role} {planner['actual'][role]}→{n}" for role, n in sorted(planner["desired"].items()))
        ago = time.time() - planner["at"]
        lines.append(f"planner ({planner['mode']}): {planner['rule']}: {planner['reason']} ({ago:.0f} s ago; {wanted})")
    for role, problem in sorted((status.get("unplaced") or {}).items()):
        lines.append(f"{role}: cannot place a replica: {problem}")
    lines.append("")
    lines.append("(TTFT of prefill replicas: their prefill phase; latencies over the last minute)")
    return "\n".join(lines)


def ask(call, timeout_s: float) -> Any:
    """ray.get of `call()` (a controller method's .remote()), asked again where the controller's
    process died under it (Ray restarts it: recovery.py; the calls that follow wait for it). No
    answer in `timeout_s` (a process stopped or an event loop stuck, which Ray takes for alive) is
    one line, not Ray's error after its own connection attempts, nor a wait for good."""
    import ray

    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            return ray.get(call(), timeout=left)
        except ray.exceptions.GetTimeoutError:
            break
        except ray.exceptions.ActorUnavailableError:
            time.sleep(min(1.0, left))  # pause between asks while Ray restarts it
    raise PDClusterError(
        f"the controller did not answer in {timeout_s:g} s: its process may be stopped or overloaded "
        "(`pdcluster down` stops the cluster all the same)"
    )


def watched(controller, every_s: float, render: Callable[[dict], str], timeout_s: float) -> Iterator[str]:
    """`controller`'s status, rendered, each time it differs from the last one yielded: looked at
    each time the controller publishes (its monitor pass, each second; a replica's start too) or
    after `every_s`; a restart of the controller does not end it, no answer in `timeout_s` does."""
    shown = None
    while True:
        text = render(ask(controller.status.remote, timeout_s))
        if text != shown:
            yield text
            shown = text
        ask(lambda: controller.next_publish.remote(every_s), every_s + timeout_s)
