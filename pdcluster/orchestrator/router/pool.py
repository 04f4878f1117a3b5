"""The router's replica pool: membership and state from the controller, the choice of a replica
by the routing policy (orchestrator/policies.py) with what each replica's cache holds
(cache_index.py), and in-flight accounting.

In-flight counts are what least-loaded routing weighs, and what the controller waits on before it
stops a draining replica, so every request holds each replica it is headed for from the moment
it is chosen until the replica is done with it (handoff.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pdcluster.errors import NoReplicaError
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.policies import ReplicaLoad, make_policy
from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router.cache_index import CacheIndex, Prompt


def exhausted(role: str, tried: Collection[str]) -> str:
    """The one message for "no replica of this role can take the request", however it came to
    that (none ready, every ready one tried, or the per-request budget of tries spent)."""
    return f"no ready {role} replica could take the request (tried: {', '.join(tried) or 'none'})"


class ReplicaPool:
    def __init__(self, policy: str, metrics: RouterMetrics):
        self.cache = CacheIndex()
        self.policy = make_policy(policy, self.cache.cached_tokens)
        self.metrics = metrics
        self.replicas: dict[str, ReplicaLoad] = {}
        self.rows: list[dict[str, Any]] = []  # as the controller sent them (engine stats for /metrics)
        self._cut: set[str] = set()  # replicas gone with requests on them, their connections cut

    def update(self, rows: list[dict[str, Any]]) -> list[str]:
        """Replace the replica table: rows of {replica_id, role, url, state, node, stats}. A
        replica that left (the controller found it dead, or it was stopped) is never chosen
        again; it keeps its entry while requests still hold it. Returns the URLs of the replicas
        that left or died with requests on them (the router cuts those connections)."""
        seen = set()
        for row in rows:
            rid = row["replica_id"]
            seen.add(rid)
            current = self.replicas.get(rid)
            if current is None:
                current = self.replicas[rid] = ReplicaLoad(rid, row["role"], row["url"])
            current.url = row["url"]
            current.state = ReplicaState(row["state"])
            current.node = row.get("node", "")
            current.meta = row
        cut = []
        for rid, replica in list(self.replicas.items()):
            left = rid not in seen
            if left and replica.inflight_requests == 0:
                del self.replicas[rid]
                self._cut.discard(rid)
                self.metrics.forget(rid, replica.role)
                continue
            if left or replica.state == ReplicaState.DEAD:
                replica.state = ReplicaState.DEAD
                if replica.inflight_requests and rid not in self._cut:
                    self._cut.add(rid)
                    cut.append(replica.url)
        self.rows = [dict(row) for row in rows]
        if self.policy.name == "cache_aware":
            self.cache.follow([row for row in rows if ReplicaState(row["state"]) != ReplicaState.DEAD])
        return cut

    def choose(self, role: str, tried: Collection[str] = (), prompt: Prompt | None = None) -> ReplicaLoad:
        """A READY replica of `role` not in `tried`; NoReplicaError (503) naming them if none.
        `prompt`: the request's, for cache-aware routing."""
        try:
            return self.policy.choose(list(self.replicas.values()), role, exclude=set(tried), prompt=prompt)
        except NoReplicaError:
            raise NoReplicaError(exhausted(role, tried)) from None

    def enter(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests += 1
        replica.inflight_prompt_tokens += tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    def leave(self, replica: ReplicaLoad, tokens: int) -> None:
        replica.inflight_requests -= 1
        replica.inflight_prompt_tokens -= tokens
        self.metrics.inflight.labels(replica.replica_id, replica.role).set(replica.inflight_requests)

    def inflight(self) -> dict[str, int]:
        return {rid: r.inflight_requests for rid, r in self.replicas.items()}

    def prefill_queue(self) -> int:
        """Prompt tokens in flight on the least loaded ready prefill replica (0: none ready)."""
        queues = [
            r.inflight_prompt_tokens
            for r in self.replicas.values()
            if r.role == "prefill" and r.state == ReplicaState.READY
        ]
        return min(queues, default=0)

    def ready_roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.replicas.values():
            if r.state == ReplicaState.READY:
                counts[r.role] = counts.get(r.role, 0) + 1
        return counts
