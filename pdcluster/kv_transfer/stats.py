"""Transfer counters the connector reports through vLLM's stats pipeline.

Worker halves accumulate into `PDTransferStats`; vLLM aggregates them across workers and hands the
`data` dict to stat loggers in the API process (SchedulerStats.kv_connector_stats), where the
engine host adds them to its totals (engine/stats.py).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
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
    # of pull_seconds: the pulling thread on a CPU, and runnable but waiting for one (the rest:
    # blocked, on the GIL, a lock or the producer)
    "pull_cpu_seconds",
    "pull_runqueue_seconds",
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


_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")


class ThreadClock:
    """The calling thread's CPU time and run-queue wait since construction, from the kernel's
    per-thread schedstat (run-queue wait reads 0 where the kernel keeps no schedstat)."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float]:
        if not _SCHEDSTAT:
            return time.thread_time(), 0.0
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9

    def elapsed(self) -> tuple[float, float]:
        """(seconds on a CPU, seconds runnable but waiting for a CPU) since construction."""
        now = self._read()
        return max(0.0, now[0] - self._start[0]), max(0.0, now[1] - self._start[1])


def machine_stalls() -> str:
    """The kernel's pressure-stall shares of the last 10 s (PSI), for a log line about a thread that
    did not run: 'cpu 12% memory 0% io 40%' (the share of time some task waited for a CPU, every
    task for memory, every task for I/O); '' where the kernel keeps none."""
    shares = []
    for resource, line in (("cpu", "some"), ("memory", "full"), ("io", "full")):
        try:
            text = Path(f"/proc/pressure/{resource}").read_text()
        except OSError:
            return ""
        found = re.search(rf"^{line} avg10=([\d.]+)", text, re.MULTILINE)
        shares.append(f"{resource} {float(found.group(1)):.0f}%" if found else f"{resource} ?")
    return " ".join(shares)


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
