"""Routing policies: which ready replica of a role gets the next request.

`least_loaded` (default) picks the replica with the least outstanding work as the router sees it:
for prefill, prompt tokens in flight; for decode (and aggregated), sequences in flight. Ties go to
the replica that was picked least recently, so equal replicas share the load. `round_robin`
cycles through ready replicas. Only READY replicas are candidates: new replicas get traffic once
ready, draining ones get none.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.errors import NoReplicaError
from pdcluster.orchestrator.replicas import ReplicaState


@dataclass
class ReplicaLoad:
    """The router's live view of one replica."""

    replica_id: str
    role: str
    url: str
    state: ReplicaState = ReplicaState.READY
    inflight_requests: int = 0
    inflight_prompt_tokens: int = 0
    last_pick: int = 0
    node: str = ""
    kv_backend: str = ""
    meta: dict = field(default_factory=dict)

    def load(self) -> int:
        return self.inflight_prompt_tokens if self.role == "prefill" else self.inflight_requests


# One clock for every policy, so `last_pick` stays comparable if the policy is swapped.
_TICK = itertools.count(1)


class Policy:
    name = ""

    def choose(self, candidates: Sequence[ReplicaLoad], role: str, exclude: set[str] = frozenset()) -> ReplicaLoad:
        ready = [
            r for r in candidates if r.role == role and r.state == ReplicaState.READY and r.replica_id not in exclude
        ]
        if not ready:
            raise NoReplicaError(f"no ready {role} replica")
        chosen = self._pick(ready)
        chosen.last_pick = next(_TICK)
        return chosen

    def _pick(self, ready: Sequence[ReplicaLoad]) -> ReplicaLoad:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def _pick(self, ready: Sequence[ReplicaLoad]) -> ReplicaLoad:
        return min(ready, key=lambda r: r.last_pick)


class LeastLoaded(Policy):
    name = "least_loaded"

    def _pick(self, ready: Sequence[ReplicaLoad]) -> ReplicaLoad:
        return min(ready, key=lambda r: (r.load(), r.last_pick))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; available: {sorted(POLICIES)}") from None
