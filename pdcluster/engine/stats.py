"""Engine-side statistics an engine host reports to the controller.

`EngineStatsRecorder` is a vLLM stat logger: AsyncLLM calls `record` with the scheduler's stats
after every engine step, and we keep the latest gauges (running/waiting requests, KV cache
usage) plus running totals of speculative-decoding counters. The base class and the stats
fields we read are shape-checked by pdcluster.compat (stat_logger_base): vLLM does not promise
to keep them.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from pdcluster import compat
from pdcluster.kv_transfer.stats import FAILURES, add_counts


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    steps_recorded: int = 0
    # vLLM's prefix cache: prompt tokens looked up, and those found cached (local hits)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # KV handoff totals (connector stats): consumer pulls, producer leases
    kv_pulls_ok: int = 0
    kv_pulls_failed: int = 0
    kv_bytes_received: int = 0
    kv_pull_seconds: float = 0.0
    kv_lease_wait_seconds: float = 0.0  # handoff stages before and after the pulls (kv_transfer/stats.py)
    kv_load_report_seconds: float = 0.0
    kv_pull_cpu_seconds: float = 0.0  # of kv_pull_seconds: the pulling thread on a CPU
    kv_pull_runqueue_seconds: float = 0.0  # ... and runnable, waiting for a CPU
    kv_pulls_one_sided: int = 0  # of kv_pulls_ok: read without a call to the producer (shm)
    kv_leases_released: int = 0
    kv_leases_expired: int = 0
    kv_backends: dict[str, str] = field(default_factory=dict)  # producer engine -> KV backend
    kv_pull_failures: dict[str, int] = field(default_factory=dict)  # cause -> failed pulls

    @property
    def acceptance_rate(self) -> float | None:
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per draft round: 1 verified token plus the accepted drafts."""
        if not self.spec_drafts:
            return None
        return 1.0 + self.spec_accepted_tokens / self.spec_drafts

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec_acceptance_rate"] = self.acceptance_rate
        out["spec_mean_accepted_length"] = self.mean_accepted_length
        return out


class EngineStatsRecorder(compat.stat_logger_base()):
    def __init__(self, vllm_config: Any = None, engine_index: int = 0):
        self._lock = threading.Lock()
        self._stats = EngineStats()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        with self._lock:
            s = self._stats
            s.running = scheduler_stats.num_running_reqs
            s.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            s.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            s.steps_recorded += 1
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                s.prefix_cache_queries += prefix.queries
                s.prefix_cache_hits += prefix.hits
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                s.spec_drafts += spec.num_drafts
                s.spec_draft_tokens += spec.num_draft_tokens
                s.spec_accepted_tokens += spec.num_accepted_tokens
            kv = scheduler_stats.kv_connector_stats
            if kv:
                for key, value in kv.items():
                    if key == "backends":
                        s.kv_backends.update(value)
                        continue
                    if key == FAILURES:
                        add_counts(s.kv_pull_failures, value)
                        continue
                    name = f"kv_{key}"
                    if hasattr(s, name):
                        setattr(s, name, getattr(s, name) + value)

    def log_engine_initialized(self) -> None:
        return

    def reset(self) -> None:
        """Forget every count so far (the host's warm-up request is not traffic)."""
        with self._lock:
            self._stats = EngineStats()

    def snapshot(self) -> EngineStats:
        with self._lock:
            return EngineStats(**asdict(self._stats))
