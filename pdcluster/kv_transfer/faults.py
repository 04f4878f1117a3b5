"""Fault injection for the KV handoff (cluster YAML `kv_transfer.fault_injection`).

Used by reliability tests and drills to prove that every failure path ends well: the request is
recomputed or failed per policy, and the producer's blocks are released. All rates default to 0;
with a rate of 1.0 the fault is certain, which is what tests use.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

from pdcluster.errors import ConfigError, InjectedFaultError


@dataclass
class FaultInjector:
    pull_failure_rate: float = 0.0  # consumer: fail a pull after its first chunk is written
    drop_release_rate: float = 0.0  # consumer: never tell the producer (lease expiry must free)
    pull_delay_s: float = 0.0  # consumer: stall before pulling
    serve_delay_s: float = 0.0  # producer: stall before streaming (consumer pull timeouts) ...
    serve_delay_rate: float = 1.0  # ... for this share of pulls
    unreachable_rate: float = 0.0  # consumer: dial a closed port instead of the producer
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for name in ("pull_failure_rate", "drop_release_rate", "unreachable_rate", "serve_delay_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"kv_transfer.fault_injection.{name}: must be in [0, 1], got {value}")
        for name in ("pull_delay_s", "serve_delay_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"kv_transfer.fault_injection.{name}: must be ≥ 0")
        self._rng.seed(self.seed)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> FaultInjector:
        allowed = {
            "pull_failure_rate", "drop_release_rate", "pull_delay_s", "serve_delay_s", "serve_delay_rate",
            "unreachable_rate", "seed",
        }
        unknown = sorted(set(cfg) - allowed)
        if unknown:
            raise ConfigError(f"kv_transfer.fault_injection: unknown keys {unknown}")
        return cls(**cfg)

    @property
    def active(self) -> bool:
        return bool(
            self.pull_failure_rate or self.drop_release_rate or self.pull_delay_s or self.serve_delay_s
            or self.unreachable_rate
        )

    def _roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def should_fail_pull(self) -> bool:
        return self._roll(self.pull_failure_rate)

    def should_stall_serving(self) -> bool:
        return bool(self.serve_delay_s) and self._roll(self.serve_delay_rate)

    def should_dial_unreachable(self) -> bool:
        return self._roll(self.unreachable_rate)

    def should_drop_release(self) -> bool:
        return self._roll(self.drop_release_rate)

    def failure(self, request_id: str) -> InjectedFaultError:
        return InjectedFaultError(f"injected KV pull failure for request {request_id}")
