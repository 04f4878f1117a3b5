"""One replica's row of `pdcluster status` (what `status --json` prints, and the table is made of):
the controller's view of it (role, node, state, stage, error), the router's (in flight, TTFT/ITL
over the last minute) and its engine's (running, waiting, KV usage, KV backends, MTP counters)."""

from __future__ import annotations

from typing import Any


def replica_row(replica, latency: dict[str, Any], inflight: dict[str, int], kv_backend: str) -> dict[str, Any]:
    """`replica`: the controller's Replica; `latency`/`inflight`: the router's, by replica id."""
    info = replica.info or {}
    stats = info.get("stats") or {}
    lat = latency.get(replica.replica_id, {})
    return {
        "replica": replica.replica_id,
        "role": replica.role,
        "node": replica.node,
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
