"""A consumer rank's links to its producers: one client per (endpoint, backend), each verified by
the layout handshake once, and the backend it uses with each producer chosen from what both
sides offer (transports/selection.py).

A client holds what its backend set up with that producer (shm rings mapped, a collective pair
group, Mooncake landing buffers, a gRPC channel). Prefill replicas come and go (scaling, the
planner, restarts on new ports), so a client nobody asked for in IDLE_CLOSE_S (or three pull
deadlines, if longer) is closed and forgotten: it would be asked for at least every lease renewal
while its producer serves this consumer, and every call that uses one (a pull, a renewal, a
release, a lease lookup) asks for it first and ends within its deadline. A producer asked for
again later gets a new client and handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdcluster.kv_transfer.kv_cache import PagedKVCache
from pdcluster.kv_transfer.protocol import ProducerInfo
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports.base import Transport, TransportClient
from pdcluster.kv_transfer.transports.selection import choose_backend, node_id

logger = logging.getLogger(__name__)

IDLE_CLOSE_S = 600.0
REAP_EVERY_S = 60.0


class ProducerLinks:
    def __init__(
        self,
        settings: KVTransferSettings,
        engine_id: str,
        cache: PagedKVCache,
        offers: list[str],
        transport: Callable[[str], Transport],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings, self.engine_id, self.cache, self.offers = settings, engine_id, cache, offers
        self._transport = transport
        self._clock = clock
        self._idle_s = max(IDLE_CLOSE_S, 3 * settings.pull_timeout_seconds)
        self._next_reap = clock() + REAP_EVERY_S
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], TransportClient] = {}  # (endpoint, backend)
        self._producers: dict[tuple[str, str], ProducerInfo] = {}  # (endpoint, backend) handshaken
        self._asked: dict[tuple[str, str], float] = {}  # (endpoint, backend) -> when last asked for

    def connection(self, endpoint: str, backend: str = "grpc") -> TransportClient:
        """A (cached) client for a producer endpoint; no handshake implied."""
        transport = self._transport(backend)
        now = self._clock()
        with self._lock:
            client = self._clients.get((endpoint, backend))
            if client is None:
                client = self._clients[(endpoint, backend)] = transport.connect(endpoint)
            self._asked[(endpoint, backend)] = now
            idle = self._take_idle(now)
        for key, old in idle:
            logger.info("closing the KV client of %s (%s): not used for %.0f s", key[0], key[1], self._idle_s)
            old.close()
        return client

    def _take_idle(self, now: float) -> list[tuple[tuple[str, str], TransportClient]]:
        """(Under the lock) forget the clients not asked for in `_idle_s`; those to close."""
        if now < self._next_reap:
            return []
        self._next_reap = now + REAP_EVERY_S
        idle = [key for key, asked in self._asked.items() if now - asked > self._idle_s]
        taken = []
        for key in idle:
            del self._asked[key]
            self._producers.pop(key, None)
            client = self._clients.pop(key, None)
            if client is not None:
                taken.append((key, client))
        return taken

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
            self._producers.clear()
            self._asked.clear()
        for client in clients:
            client.close()
