"""What the connector's scheduler half tells its worker half each step (the params that travel
between prefill, router and decode are params.KVParams).

Per step (scheduler -> worker, `PDConnectorMetadata`):
  new_leases  producer: finished prefills whose blocks are now held for a consumer to pull (and
              keys no lease will be filed under: the prefill stopped at its first token)
  queued      consumer: leases of requests that arrived here; the worker renews each on its own
              clock (lease_messages.py) until its pull ends or it is released
  awaited     consumer: requests admitted ahead of their prefill that arrived here: their lease
              is looked up (and renewed, once found) while they queue for blocks
  pulls       consumer: requests whose blocks were just allocated and must be pulled
  releases    consumer: producer leases to drop without pulling (local cache hit, aborted request)
  abandoned   consumer: requests admitted ahead of their prefill that ended before their lease
              came (the worker reports the load as done, and releases the lease if it comes)
  forsaken    consumer: requests admitted ahead that ended before their blocks were allocated
              (no pull planned): the worker releases their lease if it comes

Per step (worker -> scheduler, `PDWorkerMetadata`):
  first_tokens  consumer: the prefill's first token of each request admitted ahead of its
                prefill, once its lease is found; the scheduler makes it the last prompt token
                before the request is computed (every request in finished_recving has had its)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from pdcluster.kv_transfer.params import AwaitParams, KVParams


@dataclass(frozen=True)
class LeaseSpec:
    request_id: str
    block_ids: tuple[int, ...]
    expiry_unix: float
    key: str = ""  # the key a consumer admitted ahead finds this lease by ("": none asked)
    params: str = ""  # with a key: the signed lease (KVParams.to_dict as JSON) handed out by it;
    # "" with a key and no blocks: none comes (`stopped`: the router answers from the prefill)
    first_token: int = -1  # with a key: the token the prefill sampled (-1: none)

    @property
    def stopped(self) -> bool:
        """Files no lease: tells a lookup of `key` that its prefill stopped at its first token."""
        return bool(self.key) and not self.params


@dataclass(frozen=True)
class PullSpec:
    request_id: str  # the consumer's request id (reported back in finished_recving)
    remote: KVParams | None  # None while awaiting: the lease is found by `awaiting.key` first
    remote_block_ids: tuple[int, ...]  # the producer blocks to read, in token order
    local_block_ids: tuple[int, ...]  # where they go, same order
    awaiting: AwaitParams | None = None  # admitted ahead of its prefill (params.AwaitParams)
    remote_offset: int = 0  # awaiting: the lease's first block to read (after the local hit)
    num_tokens: int = 0  # awaiting: the prompt tokens the lease must cover


@dataclass(frozen=True)
class ReleaseSpec:
    remote: KVParams
    reason: str


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    new_leases: list[LeaseSpec] = field(default_factory=list)
    queued: list[KVParams] = field(default_factory=list)
    awaited: list[PullSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    forsaken: list[PullSpec] = field(default_factory=list)


@dataclass
class PDWorkerMetadata(KVConnectorWorkerMetadata):
    first_tokens: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PDWorkerMetadata):  # every tensor-parallel rank reports the same token
            self.first_tokens.update(other.first_tokens)
        return self


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: where this rank's KV server listens (None: no server).
    What the server offers is told to consumers in the KV handshake itself."""

    endpoint: str | None
