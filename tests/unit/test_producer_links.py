"""A consumer's clients of its producers (kv_transfer/links.py), over real gRPC on 127.0.0.1:
the client of a producer nobody asked for in a long while (a prefill scaled away, or restarted on
another port) is closed and forgotten; one in use is kept. Before, every producer ever dialed
kept its client (a channel, and per backend mapped rings, a pair group, landing buffers) for the
consumer's life."""

from __future__ import annotations

import pytest

from pdcluster.kv_transfer import links as links_module
from pdcluster.kv_transfer.links import ProducerLinks
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import create_transport
from tests.unit.kv_fixtures import make_cache

SECRET = "links-test-secret"


def test_a_producer_not_asked_for_in_a_long_while_has_its_client_closed():
    settings = KVTransferSettings(secret=SECRET, max_chunk_bytes=4096)
    transport = create_transport("grpc", settings)
    servers = [
        transport.serve(
            KVProducer(make_cache(), f"prefill-{i}", max_chunk_bytes=4096, lease_wait_s=0.5), "127.0.0.1", 0
        )
        for i in range(2)
    ]
    now = [1000.0]
    links = ProducerLinks(settings, "decode-0", make_cache(fill="zeros"), ["grpc"], lambda b: transport, lambda: now[0])
    try:
        gone, kept = (server.address for server in servers)
        old, info = links.verified(gone, "grpc")
        assert info.engine_id == "prefill-0"
        links.verified(kept, "grpc")
        now[0] += links_module.IDLE_CLOSE_S / 2
        links.connection(kept)  # still in use (renewals, pulls)
        now[0] += links_module.IDLE_CLOSE_S / 2 + links_module.REAP_EVERY_S
        assert links.connection(kept) is links.verified(kept, "grpc")[0]  # kept, and not dialed again
        with pytest.raises(ValueError, match="closed channel"):
            old.handshake(make_cache(fill="zeros").layout, "decode-0")
        new, info = links.verified(gone, "grpc")  # asked for again: a new client, handshaken again
        assert new is not old and info.engine_id == "prefill-0"
    finally:
        links.close()
        for server in servers:
            server.stop(0)
