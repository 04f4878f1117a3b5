"""Lease lookup by key (router.decode_ahead) over real gRPC on 127.0.0.1: the producer holds a
lookup until a lease it asks for is filed, a consumer's cancel frees the producer's thread at
once, held lookups never take more than half the server's threads, and the consumer's lookup
thread (kv_transfer/ahead.py) asks again at once when another request starts awaiting the same
producer, instead of waiting out the hold."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer import ahead
from pdcluster.kv_transfer import producer as producer_module
from pdcluster.kv_transfer.ahead import AheadPulls
from pdcluster.kv_transfer.metadata import PullSpec
from pdcluster.kv_transfer.params import AwaitParams, KVParams
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import create_transport
from tests.unit.kv_fixtures import make_cache

SECRET = "lookup-test-secret"
PARAMS_KEY = derive_key(SECRET, KV_PARAMS)
HOLD_S = 60.0  # far longer than any wait below: a lookup that returns did not wait out its hold
WAIT_S = 20.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)  # poll interval


@pytest.fixture
def served(monkeypatch):
    """(producer, server, a handshaken client) with one held lookup allowed (2 server threads)."""
    monkeypatch.setattr(producer_module, "HANDOUT_WAIT_CAP_S", HOLD_S)
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096, lease_wait_s=0.5)
    transport = create_transport("grpc", KVTransferSettings(secret=SECRET, max_chunk_bytes=4096, server_threads=2))
    server = transport.serve(producer, "127.0.0.1", 0)
    client = transport.connect(server.address)
    client.handshake(make_cache(fill="zeros").layout, "decode-0")
    yield producer, server, client
    client.close()
    server.stop(0)


def lookup(client, keys, interrupt=None, out=None) -> threading.Thread:
    def run():
        out.append(client.handouts(keys, engine_id="decode-0", wait_s=HOLD_S, timeout_s=5, interrupt=interrupt))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def lease(request_id: str, token: int) -> tuple[str, int]:
    """A handout as the producer files it: the signed lease as JSON, the prefill's first token."""
    params = KVParams("prefill-0", request_id, ("127.0.0.1:1",), (3,), 100, time.time() + 60).signed(PARAMS_KEY)
    return json.dumps(params.to_dict()), token


def test_a_cancelled_lookup_frees_the_producers_thread_and_held_lookups_are_capped(served):
    producer, server, client = served
    cancel, first = threading.Event(), []
    held = lookup(client, ["a" * 32], cancel, first)
    wait_until(lambda: server.lookups_held == 1, "the producer holds the lookup")
    cancel.set()
    held.join(WAIT_S)
    assert first == [None]  # cancelled: nothing answered
    wait_until(lambda: server.lookups_held == 0, "the cancelled lookup's thread is free")
    # The one slot is taken again; a second lookup meanwhile is answered at once, unheld.
    second, third = [], []
    waiting = lookup(client, ["b" * 32], None, second)
    wait_until(lambda: server.lookups_held == 1, "the producer holds the second lookup")
    lookup(client, ["c" * 32], None, third).join(WAIT_S)
    assert third == [{}]
    handout = lease("req-b", 7)
    producer.leases.add("req-b", [3], time.monotonic() + 60, key="b" * 32, handout=handout)
    waiting.join(WAIT_S)
    assert second == [{"b" * 32: handout}]  # the held lookup answered the moment its lease came


def test_a_request_that_starts_awaiting_joins_the_held_lookup_at_once(served, monkeypatch):
    """The lookup for request 1 is held; request 2 starts awaiting the same producer: the held
    call is cancelled and asked again with both keys, so request 2's lease, filed next, is found
    while request 1's never comes (held for a minute, it would not be)."""
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S)
    producer, server, client = served
    pulls: list[PullSpec] = []
    voucher = KVParams.from_dict(json.loads(lease("req-v", 1)[0]))
    pulls_ahead = AheadPulls(
        engine_id="decode-0",
        params_key=PARAMS_KEY,
        timeout_s=5,
        endpoint_for=lambda params: server.address,
        connection=lambda endpoint: client,
        submit_pull=pulls.append,
        report_failed=lambda *failed: None,
    )

    def awaiting(request_id: str, key: str) -> PullSpec:
        return PullSpec(
            request_id, None, (), (5,), awaiting=AwaitParams(key, voucher, time.time() + 600), num_tokens=100
        )

    try:
        pulls_ahead.add(awaiting("r-1", "1" * 32))
        wait_until(lambda: server.lookups_held == 1, "request 1's lookup is held")
        pulls_ahead.add(awaiting("r-2", "2" * 32))
        producer.leases.add("req-2", [3], time.monotonic() + 60, key="2" * 32, handout=lease("req-2", 9))
        wait_until(lambda: len(pulls) == 1, "request 2's lease is found")
        assert pulls[0].request_id == "r-2" and pulls[0].remote_block_ids == (3,)
        assert pulls_ahead.take_first_tokens() == {"r-2": 9}
        wait_until(lambda: server.lookups_held == 1, "request 1 still awaits, its lookup held again")
    finally:
        pulls_ahead.shutdown()
    wait_until(lambda: server.lookups_held == 0, "shutting down cancels the held lookup")
