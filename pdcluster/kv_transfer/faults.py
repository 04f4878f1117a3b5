"""Fault injection for the KV handoff (cluster YAML `kv_transfer.fault_injection`).

Used by reliability tests and drills to prove that every failure path ends well: the request is
recomputed or failed per policy, and the producer's blocks are released. All rates default to 0;
with a rate of 1.0 the fault is certain, which is what tests use.
"""

from __future__ import annotations

import random
import threading

from pdcluster.errors import InjectedFaultError
from pdcluster.kv_transfer.settings import FaultInjection


class FaultInjector:
    """The dice of one process, rolled with the validated `FaultInjection` settings."""

    def __init__(self, config: FaultInjection | None = None):
        self.config = config or FaultInjection()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()

    def _roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def should_fail_pull(self) -> bool:
        return self._roll(self.config.pull_failure_rate)

    def should_stall_serving(self) -> bool:
        return bool(self.config.serve_delay_s) and self._roll(self.config.serve_delay_rate)

    def should_dial_unreachable(self) -> bool:
        return self._roll(self.config.unreachable_rate)

    def should_drop_release(self) -> bool:
        return self._roll(self.config.drop_release_rate)

    def failure(self, request_id: str) -> InjectedFaultError:
        return InjectedFaultError(f"injected KV pull failure for request {request_id}")
