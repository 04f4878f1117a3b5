"""The transport seam: how KV bytes get from a producer's host slots to a consumer's cache.

A `Transport` makes servers (producer side, wrapping a `KVProducer`) and clients (consumer side).
Clients do three things, mirroring protos/kv_transfer.proto: `handshake`, `pull` (chunks handed to
a callback that writes them into the local cache), and `release`. Backends are registered by name
in `transports/__init__.py` and imported only when used.

Every backend's control (authentication, handshake, release) is the gRPC service; a faster backend adds
its RPCs to the producer's one gRPC server through a `ServerExtension`, so a producer can serve
several backends at once and each consumer picks one per producer (`selection.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import KVLayout, ProducerInfo
from pdcluster.kv_transfer.settings import KVTransferSettings

# Receives each chunk's bytes: a host buffer, or (collective backend on an accelerator) a tensor
# on the cache's device. Valid only during the call.
ChunkSink = Callable[[Chunk, "memoryview | torch.Tensor"], None]
# (gRPC context, method name) -> the caller's authenticated session; aborts the call otherwise
# (transports/rpc.py: build handlers with its unary_unary/unary_stream/stream_stream).
Authorize = Callable[[Any, str], Any]


class CacheSink:
    """Where a pull's chunks land: the local cache's blocks, through a BlockScatterer.

    Every backend calls it with each chunk's bytes. A backend that can fill the cache itself
    (shm's direct read) asks `host_rows()` for the destination and calls `landed` per chunk
    instead. `after_chunk` runs after each chunk landed (fault injection hooks in here).
    `one_sided`: the backend filled it without a call to the producer.
    """

    def __init__(self, scatterer: Any, after_chunk: Callable[[Chunk], None] | None = None):
        self.scatterer = scatterer
        self._after = after_chunk
        self.one_sided = False

    def __call__(self, chunk: Chunk, data: memoryview | torch.Tensor) -> None:
        self.scatterer.write(chunk, data)
        self.landed(chunk)

    def host_rows(self) -> list[tuple[int, int]] | None:
        return self.scatterer.host_rows()

    def host_regions(self) -> list[tuple[int, int, int]] | None:
        """Per layer (address, bytes, bytes per block) of the whole cache, for host caches."""
        rows = self.host_rows()
        if rows is None:
            return None
        return [(address, row * self.scatterer.cache.num_blocks, row) for address, row in rows]

    @property
    def block_ids(self) -> Sequence[int]:
        return self.scatterer.block_ids

    def landed(self, chunk: Chunk) -> None:
        if self._after is not None:
            self._after(chunk)


class TransportServer(ABC):
    @property
    @abstractmethod
    def address(self) -> str:
        """host:port clients connect to."""

    @abstractmethod
    def stop(self, grace_s: float = 1.0) -> None: ...


class TransportClient(ABC):
    @abstractmethod
    def handshake(self, local_layout: KVLayout, engine_id: str) -> ProducerInfo:
        """Exchange layouts; raise HandshakeError naming both sides on any mismatch. Returns what
        the producer's server says of itself (layout, node, device, offered backends)."""

    @abstractmethod
    def pull(
        self,
        request_id: str,
        block_ids: Sequence[int],
        sink: ChunkSink,
        *,
        engine_id: str,
        timeout_s: float,
        lease_expiry: float = 0.0,
    ) -> int:
        """Stream the producer's blocks into `sink`; return bytes received. `lease_expiry`: the
        unix time until which the producer holds the blocks (0: unknown), for backends that may
        read them without asking the producer (shm)."""

    @abstractmethod
    def release(self, request_id: str, *, transferred: bool, engine_id: str, timeout_s: float) -> bool:
        """Tell the producer it may free the request's blocks."""

    @abstractmethod
    def close(self) -> None: ...


class ServerExtension(ABC):
    """RPCs a backend adds to the producer's gRPC server, and what they hold (segments, groups)."""

    @abstractmethod
    def handlers(self, authorize: Authorize) -> dict[str, Any]:
        """gRPC method name -> grpc.RpcMethodHandler; each handler calls `authorize` first."""

    def handshake_fields(self) -> dict[str, Any]:
        """Fields this backend adds to the server's HandshakeResponse."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook: most extensions hold nothing
        """Free what the extension holds (called when the server stops)."""


class Transport(ABC):
    """A backend, run with the engine's KV settings (their secret resolved) and the device of
    the local KV cache (collective: where its buffers live)."""

    name: str = ""

    def __init__(self, settings: KVTransferSettings, device: str = "cpu"):
        self.settings = settings
        self.device = device

    def server_extension(self, producer: KVProducer, host: str) -> ServerExtension | None:
        """What this backend adds to the producer's control server (None: nothing)."""
        return None

    def serve(self, producer: KVProducer, host: str, port: int) -> TransportServer:
        """A control server that serves this backend (and the plain gRPC pull)."""
        from pdcluster.kv_transfer.transports import serve_backends

        return serve_backends([self.name], self.settings, producer, host, port, self.device)

    @abstractmethod
    def connect(self, endpoint: str) -> TransportClient: ...
