"""Transfer counters the connector reports through vLLM's stats pipeline.

Worker halves accumulate into `PDTransferStats`; vLLM aggregates them across workers and hands the
`data` dict to stat loggers in the API process (SchedulerStats.kv_connector_stats), where the
engine host adds them to its totals (engine/stats.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from pdcluster.errors import PDClusterError

COUNTERS = (
    "pulls_ok",
    "pulls_failed",
    "bytes_received",
    "pull_seconds",
    "lease_wait_seconds",  # lease filed on the producer -> its pull started here
    "load_report_seconds",  # the pull's bytes in -> vLLM told (the next get_finished)
    "pulls_one_sided",  # pulls_ok read without a call to the producer (shm: ShmClient._read_leased)
    "leases_released",
    "leases_expired",
)


BACKENDS = "backends"  # producer engine id -> the KV backend this consumer uses with it
FAILURES = "pull_failures"  # cause of a failed pull (failure_cause) -> count
_MAPS = (BACKENDS, FAILURES)


@dataclass
class PDTransferStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key in COUNTERS:
            self.data.setdefault(key, 0)
        for key in _MAPS:
            self.data.setdefault(key, {})

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] += value

    def add_failure(self, cause: str) -> None:
        add_counts(self.data[FAILURES], {cause: 1})

    def set_backend(self, producer_engine_id: str, backend: str) -> None:
        self.data[BACKENDS][producer_engine_id] = backend

    def reset(self) -> None:
        self.data = {key: 0 for key in COUNTERS}
        for key in _MAPS:
            self.data[key] = {}

    def aggregate(self, other: KVConnectorStats) -> PDTransferStats:
        for key, value in other.data.items():
            if key == FAILURES:
                add_counts(self.data.setdefault(key, {}), value)
            elif key in _MAPS:
                self.data.setdefault(key, {}).update(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, Any]:
        return {key: value for key, value in self.data.items() if key not in _MAPS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    """Add per-label counts (failed pulls by cause) into a running tally."""
    for label, count in counts.items():
        into[label] = into.get(label, 0) + count


def failure_cause(exc: BaseException) -> str:
    """A failed pull's cause as a short label: our own error classes by name (TransferTimeoutError
    -> transfer_timeout, LeaseExpiredError -> lease_expired), an OS error as os_error, anything
    else (a bug, a library's surprise) as internal."""
    if isinstance(exc, OSError):
        return "os_error"
    if not isinstance(exc, PDClusterError):
        return "internal"
    name = type(exc).__name__.removesuffix("Error") or "error"
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
