"""What the connector's scheduler half tells its worker half each step, and what travels in
`kv_transfer_params` between prefill, router and decode.

Per step (scheduler -> worker, `PDConnectorMetadata`):
  new_leases  producer: finished prefills whose blocks are now held for a consumer to pull
  pulls       consumer: requests whose blocks were just allocated and must be pulled
  releases    consumer: producer leases to drop without pulling (local cache hit, aborted request)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from pdcluster.kv_transfer.params import (  # noqa: F401 - re-exported: md.<KEY> everywhere
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_ENGINE_ID,
    REMOTE_REQUEST_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_BLOCK_IDS,
    REMOTE_NUM_TOKENS,
    REMOTE_ENDPOINTS,
    REMOTE_LEASE_EXPIRY,
    TRANSPORT,
    KV_BACKENDS,
    KV_NODE,
    KV_DEVICE,
    PROTOCOL,
    _PULL_PLANNED,
    _P_TRUNCATED,
)
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION


@dataclass(frozen=True)
class RemotePrefill:
    """Validated view of the params a decode request carries."""

    engine_id: str
    request_id: str
    endpoints: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    transport: str
    offers: tuple[str, ...] = ()
    node_id: str = ""
    device_kind: str = ""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill:
        """Raise ValueError naming the bad key when the params cannot be used."""
        try:
            endpoints = params.get(REMOTE_ENDPOINTS) or [
                f"{params[REMOTE_HOST]}:{int(params[REMOTE_PORT])}"
            ]
            version = int(params.get(PROTOCOL, PROTOCOL_VERSION))
            if version != PROTOCOL_VERSION:
                raise ValueError(
                    f"{PROTOCOL}={version}, this decode engine speaks {PROTOCOL_VERSION}"
                )
            return cls(
                engine_id=str(params[REMOTE_ENGINE_ID]),
                request_id=str(params[REMOTE_REQUEST_ID]),
                endpoints=tuple(str(e) for e in endpoints),
                block_ids=tuple(int(b) for b in params[REMOTE_BLOCK_IDS]),
                num_tokens=int(params[REMOTE_NUM_TOKENS]),
                transport=str(params.get(TRANSPORT, "grpc")),
                offers=tuple(str(b) for b in params.get(KV_BACKENDS) or [params.get(TRANSPORT, "grpc")]),
                node_id=str(params.get(KV_NODE, "")),
                device_kind=str(params.get(KV_DEVICE, "")),
            )
        except KeyError as exc:
            raise ValueError(f"kv_transfer_params lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_params malformed: {exc}") from None


@dataclass(frozen=True)
class LeaseSpec:
    request_id: str
    block_ids: tuple[int, ...]
    expiry_unix: float


@dataclass(frozen=True)
class PullSpec:
    request_id: str  # the consumer's request id (reported back in finished_recving)
    remote: RemotePrefill
    remote_block_ids: tuple[int, ...]  # the producer blocks to read, in token order
    local_block_ids: tuple[int, ...]  # where they go, same order


@dataclass(frozen=True)
class ReleaseSpec:
    remote: RemotePrefill
    reason: str


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    new_leases: list[LeaseSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: where this rank's KV server listens, what it offers."""

    endpoint: str | None
    transport: str
    offers: tuple[str, ...] = ()
    node_id: str = ""
    device_kind: str = ""
