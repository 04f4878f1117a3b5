"""Router metrics: Prometheus exposition for `/metrics`, and per-replica latency windows for
`pdcluster status` (p50/p99 over the last minute).

Request-path metrics are observed by the router itself (what clients experience). Engine-side
gauges and counters (running/waiting, KV cache usage, KV handoff bytes and pull time, speculative
decoding) are pushed by the controller with each replica update and exported by a collector.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdcluster.engine.actor import process_tree_rss

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)
# The handoff gap is read against stall budgets of tens of milliseconds (50 ms: bench/serve_report.py)
HANDOFF_GAP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
WINDOW_S = 60.0


class LatencyWindow:
    """Samples of the last WINDOW_S seconds; percentiles on demand."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = 20000):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value))

    def percentiles(self, qs=(0.5, 0.99), now: float | None = None) -> dict[str, float | None]:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            values = sorted(v for _, v in self._samples)
        out: dict[str, float | None] = {}
        for q in qs:
            key = f"p{int(q * 100)}"
            if not values:
                out[key] = None
            else:
                # nearest-rank percentile
                out[key] = values[max(0, min(len(values) - 1, math.ceil(q * len(values)) - 1))]
        out["count"] = len(values)
        return out


class ReplicaWindows:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.ttft = LatencyWindow(window_s)
        self.itl = LatencyWindow(window_s)
        self.phase = LatencyWindow(window_s)  # prefill replicas: time of the prefill call

    def summary(self) -> dict[str, Any]:
        return {"ttft": self.ttft.percentiles(), "itl": self.itl.percentiles(), "phase": self.phase.percentiles()}


class _EngineCollector:
    """Exports the engine stats the controller last pushed, per replica."""

    def __init__(self, source) -> None:
        self._source = source  # callable -> list[dict(replica_id, role, stats)]

    def collect(self):
        running = GaugeMetricFamily(
            "pdcluster_replica_running", "Sequences running in the engine", labels=["replica", "role"]
        )
        waiting = GaugeMetricFamily(
            "pdcluster_replica_waiting", "Requests waiting in the engine queue", labels=["replica", "role"]
        )
        kv_usage = GaugeMetricFamily(
            "pdcluster_replica_kv_cache_usage", "Fraction of KV cache blocks in use", labels=["replica", "role"]
        )
        pulls = CounterMetricFamily("pdcluster_kv_pulls", "KV pulls by decode replicas", labels=["replica", "outcome"])
        pull_failures = CounterMetricFamily(
            "pdcluster_kv_pull_failures",
            "Failed KV pulls by cause (recomputed or failed per policy)",
            labels=["replica", "cause"],
        )
        kv_bytes = CounterMetricFamily(
            "pdcluster_kv_handoff_bytes", "KV bytes pulled by decode replicas", labels=["replica"]
        )
        kv_seconds = CounterMetricFamily(
            "pdcluster_kv_pull_seconds",
            "Time spent in KV pulls (sum; divide by pulls for the mean)",
            labels=["replica"],
        )
        pull_cpu = CounterMetricFamily(
            "pdcluster_kv_pull_cpu_seconds",
            "Of the KV pulls' time: their thread on a CPU (sum; the rest is waiting for a CPU or blocked)",
            labels=["replica"],
        )
        pull_runqueue = CounterMetricFamily(
            "pdcluster_kv_pull_runqueue_seconds",
            "Of the KV pulls' time: their thread runnable but waiting for a CPU (sum; 0 without schedstat)",
            labels=["replica"],
        )
        lease_wait = CounterMetricFamily(
            "pdcluster_kv_lease_wait_seconds",
            "From a lease's filing on the prefill replica to its pull's start (sum; divide by pulls; "
            "across hosts it includes their clock offset)",
            labels=["replica"],
        )
        load_report = CounterMetricFamily(
            "pdcluster_kv_load_report_seconds",
            "From a pull's last byte to vLLM hearing of it at the engine's next step (sum; divide by pulls)",
            labels=["replica"],
        )
        one_sided = CounterMetricFamily(
            "pdcluster_kv_pulls_one_sided",
            "Successful KV pulls read without a call to the prefill replica (shm one-sided reads)",
            labels=["replica"],
        )
        leases = CounterMetricFamily(
            "pdcluster_kv_leases", "KV leases ended on prefill replicas", labels=["replica", "outcome"]
        )
        drafts = CounterMetricFamily("pdcluster_spec_draft_tokens", "MTP draft tokens proposed", labels=["replica"])
        accepted = CounterMetricFamily(
            "pdcluster_spec_accepted_tokens", "MTP draft tokens accepted", labels=["replica"]
        )
        rate = GaugeMetricFamily(
            "pdcluster_spec_acceptance_rate", "Accepted / draft tokens since start", labels=["replica"]
        )
        length = GaugeMetricFamily(
            "pdcluster_spec_mean_accepted_length", "Tokens per draft round (1 + accepted / rounds)", labels=["replica"]
        )
        prefix_queries = CounterMetricFamily(
            "pdcluster_prefix_cache_queries", "Prompt tokens looked up in the engine's prefix cache", labels=["replica"]
        )
        prefix_hits = CounterMetricFamily(
            "pdcluster_prefix_cache_hits", "Prompt tokens found in the engine's prefix cache", labels=["replica"]
        )
        rss = GaugeMetricFamily(
            "pdcluster_replica_rss_bytes",
            "Resident memory of the replica's actor and engine processes",
            labels=["replica", "role"],
        )
        for row in self._source():
            stats = row.get("stats") or {}
            rid, role = row["replica_id"], row["role"]
            running.add_metric([rid, role], stats.get("running", 0))
            waiting.add_metric([rid, role], stats.get("waiting", 0))
            kv_usage.add_metric([rid, role], stats.get("kv_cache_usage", 0.0))
            prefix_queries.add_metric([rid], stats.get("prefix_cache_queries", 0))
            prefix_hits.add_metric([rid], stats.get("prefix_cache_hits", 0))
            if row.get("rss_bytes"):
                rss.add_metric([rid, role], row["rss_bytes"])
            if role in ("decode", "aggregated"):
                pulls.add_metric([rid, "ok"], stats.get("kv_pulls_ok", 0))
                pulls.add_metric([rid, "failed"], stats.get("kv_pulls_failed", 0))
                for cause, count in sorted((stats.get("kv_pull_failures") or {}).items()):
                    pull_failures.add_metric([rid, cause], count)
                kv_bytes.add_metric([rid], stats.get("kv_bytes_received", 0))
                kv_seconds.add_metric([rid], stats.get("kv_pull_seconds", 0.0))
                pull_cpu.add_metric([rid], stats.get("kv_pull_cpu_seconds", 0.0))
                pull_runqueue.add_metric([rid], stats.get("kv_pull_runqueue_seconds", 0.0))
                lease_wait.add_metric([rid], stats.get("kv_lease_wait_seconds", 0.0))
                load_report.add_metric([rid], stats.get("kv_load_report_seconds", 0.0))
                one_sided.add_metric([rid], stats.get("kv_pulls_one_sided", 0))
                drafts.add_metric([rid], stats.get("spec_draft_tokens", 0))
                accepted.add_metric([rid], stats.get("spec_accepted_tokens", 0))
                if stats.get("spec_acceptance_rate") is not None:
                    rate.add_metric([rid], stats["spec_acceptance_rate"])
                if stats.get("spec_mean_accepted_length") is not None:
                    length.add_metric([rid], stats["spec_mean_accepted_length"])
            if role == "prefill":
                leases.add_metric([rid, "released"], stats.get("kv_leases_released", 0))
                leases.add_metric([rid, "expired"], stats.get("kv_leases_expired", 0))
        yield from (
            running,
            waiting,
            kv_usage,
            rss,
            pulls,
            pull_failures,
            kv_bytes,
            kv_seconds,
            pull_cpu,
            pull_runqueue,
            lease_wait,
            load_report,
            one_sided,
            leases,
            drafts,
            accepted,
            rate,
            length,
            prefix_queries,
            prefix_hits,
        )


class _CacheIndexCollector:
    """The router's view of each replica's KV cache (cache_index.py), for cache-aware routing."""

    def __init__(self, source) -> None:
        self._source = source  # callable -> {replica_id: {source, blocks, history, synced}}

    def collect(self):
        blocks = GaugeMetricFamily(
            "pdcluster_cache_index_blocks",
            "Blocks the router knows a replica's KV cache holds, by where its matches come from now "
            "(events: the engine's KV events, in sync; history: the prompts the router sent it)",
            labels=["replica", "source"],
        )
        for rid, entry in self._source().items():
            blocks.add_metric(
                [rid, entry["source"]], entry["blocks"] if entry["source"] == "events" else entry["history"]
            )
        yield blocks


class RouterMetrics:
    def __init__(self, engine_rows, cache_index=dict, slo_window_s: float = WINDOW_S) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdcluster_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "pdcluster_ttft_seconds", "Time to first token (router view)", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdcluster_itl_seconds", "Inter-token latency (router view)", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram("pdcluster_e2e_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(
            "pdcluster_prefill_seconds", "Prefill phase incl. KV lease setup", buckets=LATENCY_BUCKETS, registry=r
        )
        self.handoff_gap = Histogram(
            "pdcluster_handoff_gap_seconds",
            "Streams continued after the prefill's first token: the gap between that token and the decode "
            "replica's first one, as relayed to the client (the KV handoff and a decode step sit in it)",
            buckets=HANDOFF_GAP_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "pdcluster_replica_inflight",
            "Requests the router has in flight per replica",
            ["replica", "role"],
            registry=r,
        )
        self.retries = Counter("pdcluster_retries", "Phase retries on another replica", ["role"], registry=r)
        self.first_token_source = Counter(
            "pdcluster_first_token_source",
            "Disaggregated requests by the replica whose first token the client got",
            ["role"],
            registry=r,
        )
        self.decode_ahead = Counter(
            "pdcluster_decode_ahead",
            "Continuations sent with their prefill request (router.decode_ahead): streamed, or dropped "
            "for one sent after the prefill (its answer did not match what they assumed, or it failed); "
            "lost: streamed, then the decode engine got no KV for it before its first token and the one "
            "sent after the prefill went instead",
            ["outcome"],
            registry=r,
        )
        self.migrations = Counter(
            "pdcluster_stream_migrations",
            "Decode streams that broke mid-stream, by whether another decode replica continued them",
            ["outcome"],
            registry=r,
        )
        self.routes = Counter(
            "pdcluster_route_decisions",
            "Disaggregated requests by path: prefill then decode (pd), decode alone (decode: several "
            "choices or prompts, or no prefill replica ready), or decode computing the few tokens its "
            "cache lacks (local_prefill), or decode computing the prompt because prefill's queue is long "
            "(local_queue)",
            ["path"],
            registry=r,
        )
        self.planner_decisions = Counter(
            "pdcluster_planner_decisions",
            "SLO planner decisions that acted (or would, in advise mode), by role, action and rule",
            ["role", "action", "reason"],
            registry=r,
        )
        self.planner_replicas = Gauge(
            "pdcluster_planner_replicas",
            "Replicas per role: what the SLO planner wants (desired) and what runs (actual)",
            ["role", "kind"],
            registry=r,
        )
        router_rss = Gauge("pdcluster_router_rss_bytes", "Resident memory of the router process", registry=r)
        router_rss.set_function(process_tree_rss)  # as `status` reports it
        r.register(_EngineCollector(engine_rows))
        r.register(_CacheIndexCollector(cache_index))
        self.windows: dict[str, ReplicaWindows] = {}
        self.cluster = ReplicaWindows(slo_window_s)  # every replica's samples: the SLO planner's input

    def whole_answer(self, ttft_s: float, first_at: float, content: bytes) -> None:
        """An answer sent whole (not streamed): its client sees no first token or gaps, but the
        SLO planner needs the cluster's (orchestrator/planner.py), or non-streamed traffic leaves
        it blind. Its window gets the server's view: token 1 after `ttft_s` (computed at
        `first_at`, perf_counter), then the mean gap of the tokens after it (never the
        client-facing histograms)."""
        now = time.perf_counter()
        try:
            tokens = int(json.loads(content)["usage"]["completion_tokens"])
        except (ValueError, TypeError, KeyError):
            return  # no usage to count its tokens by
        self.cluster.ttft.add(ttft_s)
        if tokens > 1:
            self.cluster.itl.add((now - first_at) / (tokens - 1))

    def slo(self) -> dict[str, float | None]:
        """The cluster's p90 TTFT, ITL and prefill phase (seconds) over the SLO window."""
        return {name: getattr(self.cluster, name).percentiles((0.9,))["p90"] for name in ("ttft", "itl", "phase")}

    def forget(self, replica_id: str, role: str) -> None:
        """A replica left the pool for good: its series and latency window go with it (replicas
        come and go with scaling and restarts, each under a new id)."""
        self.windows.pop(replica_id, None)
        with contextlib.suppress(KeyError):  # (one that never had a request has no series)
            self.inflight.remove(replica_id, role)

    def window(self, replica_id: str) -> ReplicaWindows:
        w = self.windows.get(replica_id)
        if w is None:
            w = self.windows[replica_id] = ReplicaWindows()
        return w

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
