"""What the connector's scheduler half tells its worker half each step (the params that travel
between prefill, router and decode are params.KVParams).

Per step (scheduler -> worker, `PDConnectorMetadata`):
  new_leases  producer: finished prefills whose blocks are now held for a consumer to pull
  pulls       consumer: requests whose blocks were just allocated and must be pulled
  releases    consumer: producer leases to drop without pulling (local cache hit, aborted request)
  renewals    consumer: leases of requests still queued here, to keep (every lease_seconds / 6)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from pdcluster.kv_transfer.params import KVParams


@dataclass(frozen=True)
class LeaseSpec:
    request_id: str
    block_ids: tuple[int, ...]
    expiry_unix: float


@dataclass(frozen=True)
class PullSpec:
    request_id: str  # the consumer's request id (reported back in finished_recving)
    remote: KVParams
    remote_block_ids: tuple[int, ...]  # the producer blocks to read, in token order
    local_block_ids: tuple[int, ...]  # where they go, same order
    renewed_until: float = 0.0  # unix time the consumer's renewals kept the lease to (0: none)


@dataclass(frozen=True)
class ReleaseSpec:
    remote: KVParams
    reason: str


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    new_leases: list[LeaseSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    renewals: list[KVParams] = field(default_factory=list)


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: where this rank's KV server listens (None: no server).
    What the server offers is told to consumers in the KV handshake itself."""

    endpoint: str | None
