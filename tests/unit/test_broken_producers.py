"""A producer that breaks the wire protocol (in another process, over real gRPC and gloo) is a
failed pull that says what the producer did, as a KVTransferError the connector counts and
recovers from, never an error of the consumer's own code."""

from __future__ import annotations

import pytest

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport
from tests.unit.kv_fixtures import make_cache
from tests.unit.kv_producer import CHUNK, REQUESTS, running_producer, settings


def test_a_collective_pull_that_ends_without_its_last_message_is_a_failed_pull():
    """Every chunk sent, then the stream ends without the producer's "done" (with its byte
    count): once an AttributeError of the consumer's own message."""
    with running_producer(collective_without_done=True) as (address, _):
        consumer = make_cache(fill="zeros")
        client = create_transport("collective", settings()).connect(address)
        try:
            client.handshake(consumer.layout, "decode-0")
            scatterer = BlockScatterer(consumer, CHUNK)
            scatterer.begin([7, 8])
            with pytest.raises(KVTransferError, match="ended the pull before saying it was done"):
                client.pull("req-c", REQUESTS["req-c"], scatterer.write, engine_id="decode-0", timeout_s=20)
        finally:
            client.close()
