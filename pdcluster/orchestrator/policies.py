"""Routing policies: which ready replica of a role gets the next request.

`least_loaded` (default) picks the replica with the least outstanding work as the router sees it:
for prefill, prompt tokens in flight; for decode (and aggregated), sequences in flight. Ties go to
the replica that was picked least recently, so equal replicas share the load. `round_robin`
cycles through ready replicas. Only READY replicas are candidates: new replicas get traffic once
ready, draining ones get none.

`cache_aware` also weighs what each replica's KV cache already holds of the request's prompt
(orchestrator/router/cache_index.py):
  - prefill (and aggregated): the least cost, cost = prompt tokens the replica would compute (its
    uncached ones) + prompt tokens it already has in flight (their uncached ones, as counted when
    they were routed). Both are tokens of prefill compute, so they weigh the same: a replica that
    holds a 6k-token prefix wins until it has about 6k tokens more queued than the others.
  - decode: among the replicas within DECODE_LOAD_SLACK sequences (or a quarter, whichever is
    more) of the least loaded, the one holding the most leading blocks (decode pulls only the
    blocks it lacks, and may compute a short remainder itself: the router's local-prefill path).
Without a known prompt (no tokenizer yet, several prompts) it is `least_loaded`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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


DECODE_LOAD_SLACK = 2

# What a replica's cache holds of a request's prompt, in tokens: (replica_id, prompt) -> tokens.
CachedTokens = Callable[[str, Any], int]


class Policy:
    name = ""

    def __init__(self, cached: CachedTokens | None = None):
        self.cached = cached

    def choose(
        self, candidates: Sequence[ReplicaLoad], role: str, exclude: set[str] = frozenset(), prompt: Any = None
    ) -> ReplicaLoad:
        ready = [
            r for r in candidates if r.role == role and r.state == ReplicaState.READY and r.replica_id not in exclude
        ]
        if not ready:
            raise NoReplicaError(f"no ready {role} replica")
        chosen = self._pick(ready, prompt)
        chosen.last_pick = next(_TICK)
        return chosen

    def _pick(self, ready: Sequence[ReplicaLoad], prompt: Any) -> ReplicaLoad:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def _pick(self, ready: Sequence[ReplicaLoad], prompt: Any) -> ReplicaLoad:
        return min(ready, key=lambda r: r.last_pick)


class LeastLoaded(Policy):
    name = "least_loaded"

    def _pick(self, ready: Sequence[ReplicaLoad], prompt: Any) -> ReplicaLoad:
        return min(ready, key=lambda r: (r.load(), r.last_pick))


class CacheAware(LeastLoaded):
    name = "cache_aware"

    def _pick(self, ready: Sequence[ReplicaLoad], prompt: Any) -> ReplicaLoad:
        if prompt is None or self.cached is None or not getattr(prompt, "hashes", None):
            return super()._pick(ready, prompt)
        held = {r.replica_id: self.cached(r.replica_id, prompt) for r in ready}
        if ready[0].role == "decode":
            least = min(r.inflight_requests for r in ready)
            near = [r for r in ready if r.inflight_requests <= least + max(DECODE_LOAD_SLACK, least // 4)]
            return min(near, key=lambda r: (-held[r.replica_id], r.inflight_requests, r.last_pick))
        return min(ready, key=lambda r: (prompt.count - held[r.replica_id] + r.inflight_prompt_tokens, r.last_pick))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}


def make_policy(name: str, cached: CachedTokens | None = None) -> Policy:
    """The policy `name`; `cached` tells cache_aware what each replica holds of a prompt."""
    try:
        return POLICIES[name](cached)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; available: {sorted(POLICIES)}") from None
