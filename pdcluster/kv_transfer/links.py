"""A consumer rank's links to its producers: one client per (endpoint, backend), each verified by
the layout handshake once, and the backend it uses with each producer chosen from what both
sides offer (transports/selection.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pdcluster.kv_transfer.kv_cache import PagedKVCache
from pdcluster.kv_transfer.protocol import ProducerInfo
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports.base import Transport, TransportClient
from pdcluster.kv_transfer.transports.selection import choose_backend, node_id


class ProducerLinks:
    def __init__(
        self,
        settings: KVTransferSettings,
        engine_id: str,
        cache: PagedKVCache,
        offers: list[str],
        transport: Callable[[str], Transport],
    ):
        self.settings, self.engine_id, self.cache, self.offers = settings, engine_id, cache, offers
        self._transport = transport
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], TransportClient] = {}  # (endpoint, backend)
        self._producers: dict[tuple[str, str], ProducerInfo] = {}  # (endpoint, backend) handshaken

    def connection(self, endpoint: str, backend: str = "grpc") -> TransportClient:
        """A (cached) client for a producer endpoint; no handshake implied."""
        transport = self._transport(backend)
        with self._lock:
            client = self._clients.get((endpoint, backend))
            if client is None:
                client = self._clients[(endpoint, backend)] = transport.connect(endpoint)
            return client

    def verified(self, endpoint: str, backend: str) -> tuple[TransportClient, ProducerInfo]:
        """A client whose producer passed the layout handshake (once per endpoint and backend),
        and what that producer said of itself there."""
        client = self.connection(endpoint, backend)
        with self._lock:
            info = self._producers.get((endpoint, backend))
        if info is None:
            info = client.handshake(self.cache.layout, self.engine_id)  # raises HandshakeError
            with self._lock:
                self._producers[(endpoint, backend)] = info
        return client, info

    def backend_for(self, endpoint: str, info: ProducerInfo) -> str:
        """The backend this consumer uses with that producer (raises naming both sides)."""
        return choose_backend(
            self.settings.backend,
            local_node=node_id(),
            local_device=self.cache.device.type,
            remote_node=info.node_id,
            remote_device=info.device_kind,
            remote_offers=info.offers,
            remote_engine=info.engine_id or endpoint,
            encrypted=self.settings.tls is not None,
            local_offers=self.offers,
        )

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
