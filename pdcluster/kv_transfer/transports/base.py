"""The transport seam: how KV bytes get from a producer's host slots to a consumer's cache.

A `Transport` makes servers (producer side, wrapping a `KVProducer`) and clients (consumer side).
Clients do three things, mirroring protos/kv_transfer.proto: `handshake`, `pull` (chunks handed to
a callback that writes them into the local cache), and `release`. Backends are registered by name
in `transports/__init__.py` and imported only when used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import DEFAULT_CHUNK_BYTES, KVLayout

ChunkSink = Callable[[Chunk, memoryview], None]


@dataclass(frozen=True)
class TransportSettings:
    secret: str
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    connect_timeout_s: float = 5.0
    server_threads: int = 8


class TransportServer(ABC):
    @property
    @abstractmethod
    def address(self) -> str:
        """host:port clients connect to."""

    @abstractmethod
    def stop(self, grace_s: float = 1.0) -> None: ...


class TransportClient(ABC):
    @abstractmethod
    def handshake(self, local_layout: KVLayout, engine_id: str) -> KVLayout:
        """Exchange layouts; raise HandshakeError naming both sides on any mismatch."""

    @abstractmethod
    def pull(
        self,
        request_id: str,
        block_ids: Sequence[int],
        sink: ChunkSink,
        *,
        engine_id: str,
        timeout_s: float,
    ) -> int:
        """Stream the producer's blocks into `sink`; return bytes received."""

    @abstractmethod
    def release(self, request_id: str, *, transferred: bool, engine_id: str, timeout_s: float) -> bool:
        """Tell the producer it may free the request's blocks."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    name: str = ""

    def __init__(self, settings: TransportSettings):
        self.settings = settings

    @abstractmethod
    def serve(self, producer: KVProducer, host: str, port: int) -> TransportServer: ...

    @abstractmethod
    def connect(self, endpoint: str) -> TransportClient: ...
