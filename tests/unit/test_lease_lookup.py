"""Lease lookup by key (router.decode_ahead) over real gRPC on 127.0.0.1: the producer holds a
lookup until a lease it asks for is filed, a consumer's cancel frees the producer's thread at
once, held lookups never take more than half the server's threads, and the consumer's lookup
thread (kv_transfer/ahead.py) asks again at once when another request starts awaiting the same
producer, instead of waiting out the hold; the requests of every producer are looked up however
many producers hold a lookup, and a lease found for a request that ended meanwhile is released."""

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
from pdcluster.kv_transfer.failures import FAILURE_SOCKET_ENV, FailureInbox
from pdcluster.kv_transfer.lease_messages import LeaseMessages
from pdcluster.kv_transfer.metadata import PullSpec
from pdcluster.kv_transfer.params import AwaitParams, KVParams
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import create_transport
from tests.unit.kv_fixtures import make_cache
from tests.unit.replica_stand_ins import closed_port

SECRET = "lookup-test-secret"
PARAMS_KEY = derive_key(SECRET, KV_PARAMS)
HOLD_S = 60.0  # far longer than any wait below: a lookup that returns did not wait out its hold
WAIT_S = 20.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)  # poll interval


def serve_one(engine_id: str = "prefill-0"):
    """(producer, server, a handshaken client) with one held lookup allowed (2 server threads)."""
    producer = KVProducer(make_cache(), engine_id, max_chunk_bytes=4096, lease_wait_s=0.5)
    transport = create_transport("grpc", KVTransferSettings(secret=SECRET, max_chunk_bytes=4096, server_threads=2))
    server = transport.serve(producer, "127.0.0.1", 0)
    client = transport.connect(server.address)
    client.handshake(make_cache(fill="zeros").layout, "decode-0")
    return producer, server, client


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(producer_module, "HANDOUT_WAIT_CAP_S", HOLD_S)
    producer, server, client = serve_one()
    yield producer, server, client
    client.close()
    server.stop(0)


def lookup(client, keys, interrupt=None, out=None) -> threading.Thread:
    def run():
        out.append(client.handouts(keys, engine_id="decode-0", wait_s=HOLD_S, timeout_s=5, interrupt=interrupt))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def lease(request_id: str, token: int, endpoint: str = "127.0.0.1:1") -> tuple[str, int]:
    """A handout as the producer files it: the signed lease as JSON, the prefill's first token."""
    params = KVParams("prefill-0", request_id, (endpoint,), (3,), 100, time.time() + 60).signed(PARAMS_KEY)
    return json.dumps(params.to_dict()), token


def awaiting(request_id: str, key: str, endpoint: str = "127.0.0.1:1") -> PullSpec:
    """A request admitted ahead of its prefill, awaiting the producer at `endpoint`."""
    voucher = KVParams.from_dict(json.loads(lease("req-v", 1, endpoint)[0]))
    return PullSpec(request_id, None, (), (5,), awaiting=AwaitParams(key, voucher, time.time() + 600), num_tokens=100)


def ahead_pulls(
    connection,
    pulls: list,
    release=lambda lease: None,
    report_failed=lambda *failed: None,
    timeout_s: float = 5,
    hold=lambda lease: None,
) -> AheadPulls:
    """The consumer's lookups, dialing the producer each request's voucher names."""
    return AheadPulls(
        engine_id="decode-0",
        params_key=PARAMS_KEY,
        timeout_s=timeout_s,
        endpoint_for=lambda params: params.remote_endpoints[0],
        connection=connection,
        submit_pull=pulls.append,
        report_failed=report_failed,
        release=release,
        hold=hold,
    )


def join_the_held_lookup(pulls_ahead: AheadPulls, server) -> None:
    """Request 1 awaits the producer (its lookup held), then request 2 starts awaiting it too."""
    pulls_ahead.add(awaiting("r-1", "1" * 32, server.address))
    wait_until(lambda: server.lookups_held == 1, "request 1's lookup is held")
    pulls_ahead.add(awaiting("r-2", "2" * 32, server.address))


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
    pulls_ahead = ahead_pulls(lambda endpoint: client, pulls)
    try:
        join_the_held_lookup(pulls_ahead, server)
        producer.leases.add("req-2", [3], time.monotonic() + 60, key="2" * 32, handout=lease("req-2", 9))
        wait_until(lambda: len(pulls) == 1, "request 2's lease is found")
        assert pulls[0].request_id == "r-2" and pulls[0].remote_block_ids == (3,)
        assert pulls_ahead.take_first_tokens() == {"r-2": 9}
        wait_until(lambda: server.lookups_held == 1, "request 1 still awaits, its lookup held again")
    finally:
        pulls_ahead.shutdown()
    wait_until(lambda: server.lookups_held == 0, "shutting down cancels the held lookup")


def test_a_lookup_cancelled_for_a_new_key_does_not_cancel_the_one_after_it(served, monkeypatch):
    """Request 2 joins request 1's held lookup: the held call is cancelled and asked again with
    both keys, once. The cancelled call's completion, which gRPC reports later on its own thread,
    set the lookup's `changed` event after the lookup had cleared it for the next call: that call
    was cancelled at once, its own completion cancelled the one after, and so on (dozens of
    authenticated calls a second to the prefill's server while both requests waited)."""
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S)
    producer, server, client = served
    asked: list[list[str]] = []
    more = threading.Event()
    handouts = producer.handouts

    def counted(keys, *args):
        asked.append(sorted(keys))
        if len(asked) > 2:
            more.set()
        return handouts(keys, *args)

    monkeypatch.setattr(producer, "handouts", counted)
    pulls_ahead = ahead_pulls(lambda endpoint: client, [])
    try:
        join_the_held_lookup(pulls_ahead, server)
        both = ["1" * 32, "2" * 32]
        wait_until(lambda: asked[-1] == both and server.lookups_held == 1, "both requests' lookup is held")
        # Nothing changes from here on: a further call can only be one cancelled for nothing.
        assert not more.wait(1.0), f"{len(asked)} lookups: {asked[:4]} ..."
        assert asked == [["1" * 32], both]
    finally:
        pulls_ahead.shutdown()


def test_a_lookup_asked_again_after_a_cancel_is_held_while_the_cancelled_calls_thread_finishes(served, monkeypatch):
    """The server allows one held lookup here. Request 2 joins request 1's held lookup: the held
    call is cancelled and asked again with both keys. The cancelled call's thread had not yet
    returned (held back here until the new call is in) when the new call came: its slot still
    counted, so the new call was answered at once, unheld, and the consumer asked a third time
    after its retry pause (a lease filed meanwhile found that much later). A cancelled call's slot
    is free the moment gRPC reports the cancel."""
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S)
    producer, server, client = served
    holds: list[float] = []
    second_in = threading.Event()
    handouts = producer.handouts

    def counted(keys, wait_s, stop):
        holds.append(wait_s)
        if len(holds) > 1:
            second_in.set()
        found = handouts(keys, wait_s, stop)
        if len(holds) == 1:  # the cancelled call's thread, descheduled before it returns
            second_in.wait(WAIT_S)
        return found

    monkeypatch.setattr(producer, "handouts", counted)
    pulls_ahead = ahead_pulls(lambda endpoint: client, [])
    try:
        join_the_held_lookup(pulls_ahead, server)
        wait_until(second_in.is_set, "the lookup is asked again with both keys")
        assert holds[1] == HOLD_S, f"the call asked again was answered unheld: holds {holds}"
    finally:
        pulls_ahead.shutdown()


def test_the_requests_of_every_producer_are_looked_up_while_others_hold_their_lookups(monkeypatch):
    """Five producers, a request awaiting each; the first four's leases never come (their
    lookups stay held for a minute). The fifth's lease, filed next, is found: each producer
    awaited has a lookup of its own (a pool of four threads left the fifth's unasked)."""
    monkeypatch.setattr(producer_module, "HANDOUT_WAIT_CAP_S", HOLD_S)
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S)
    producers = [serve_one(f"prefill-{i}") for i in range(5)]
    clients = {server.address: client for _, server, client in producers}
    pulls: list[PullSpec] = []
    pulls_ahead = ahead_pulls(clients.__getitem__, pulls)
    try:
        for i, (_, server, _) in enumerate(producers[:4]):
            pulls_ahead.add(awaiting(f"r-{i}", str(i) * 32, server.address))
            wait_until(lambda server=server: server.lookups_held == 1, f"request {i}'s lookup is held")
        producer, server, _ = producers[4]
        pulls_ahead.add(awaiting("r-4", "4" * 32, server.address))
        producer.leases.add("req-4", [3], time.monotonic() + 60, key="4" * 32, handout=lease("req-4", 9))
        wait_until(lambda: len(pulls) == 1, "the fifth producer's lease is found")
        assert pulls[0].request_id == "r-4" and pulls_ahead.take_first_tokens() == {"r-4": 9}
    finally:
        pulls_ahead.shutdown()
        for _, server, client in producers:
            client.close()
            server.stop(0)


@pytest.mark.parametrize("ended", ["while-held", "abandoned", "forsaken"])
def test_a_lease_filed_after_its_request_ended_is_released(served, monkeypatch, ended):
    """The request ends before its prefill files the lease: while its lookup is held (the lease,
    filed next, is answered to that call), or abandoned with its blocks allocated, or forsaken
    while queued on decode, its lookups over by the time the lease is filed (the key is still
    looked up until the request's deadline). The consumer releases the lease at once: the
    producer frees the blocks now, not when the lease expires (60 s here)."""
    held = ended == "while-held"
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S if held else 0.2)
    producer, server, client = served

    def release(lease: KVParams) -> None:
        client.release(lease.remote_request_id, transferred=False, engine_id="decode-0", timeout_s=5)

    pulls: list[PullSpec] = []
    pulls_ahead = ahead_pulls(lambda endpoint: client, pulls, release)
    try:
        if ended == "forsaken":
            pulls_ahead.forsake(awaiting("r-1", "1" * 32, server.address))
        else:
            pulls_ahead.add(awaiting("r-1", "1" * 32, server.address))
            if held:
                wait_until(lambda: server.lookups_held == 1, "request 1's lookup is held")
            pulls_ahead.abandon("r-1")
        if not held:
            time.sleep(0.5)  # past any lookup that was in flight when it ended
        producer.leases.add("req-1", [3], time.monotonic() + 60, key="1" * 32, handout=lease("req-1", 9))
        wait_until(lambda: len(producer.leases) == 0, "the lease of the ended request is released")
        assert pulls == [] and pulls_ahead.take_first_tokens() == {}
    finally:
        pulls_ahead.shutdown()


def test_under_tensor_parallel_a_rank_that_gave_up_reports_once_told_the_request_ended(served, monkeypatch):
    """Two ranks of one decode engine look the same request's lease up, each on its own producer
    rank: one finds it, the other's producer is unreachable, so it gives up (and has the request
    aborted). The scheduler then tells both that the request ended: the rank that gave up reports
    its load as failed, once; the one that found it reports through its pull, not here."""
    producer, server, client = served
    inbox = FailureInbox(on_abort=(aborted := []).append)  # the engine's API process: aborts
    monkeypatch.setenv(FAILURE_SOCKET_ENV, inbox.path)
    found_pulls: list[PullSpec] = []
    reports: dict[str, list[tuple]] = {"found": [], "gave up": []}
    unreachable = f"127.0.0.1:{closed_port()}"
    ranks = {}
    connections = {
        "found": lambda endpoint: client,
        "gave up": lambda endpoint: create_transport("grpc", KVTransferSettings(secret=SECRET)).connect(endpoint),
    }
    for rank, connection in connections.items():
        report = reports[rank].append
        ranks[rank] = ahead_pulls(
            connection, found_pulls, report_failed=lambda *failed, r=report: r(failed), timeout_s=2
        )
    try:
        producer.leases.add("req-1", [3], time.monotonic() + 60, key="1" * 32, handout=lease("req-1", 9))
        for rank, endpoint in [("found", server.address), ("gave up", unreachable)]:
            ranks[rank].add(awaiting("r-1", "1" * 32, endpoint))
        wait_until(lambda: len(found_pulls) == 1, "one rank finds the lease")
        wait_until(lambda: aborted == ["r-1"], "the other gives up and has the request aborted")
        assert reports == {"found": [], "gave up": []}  # no report before the request ended
        for pulls_ahead in ranks.values():
            pulls_ahead.abandon("r-1")
            pulls_ahead.abandon("r-1")  # told twice: reported once
        assert reports["found"] == [] and [r[0] for r in reports["gave up"]] == ["r-1"]
    finally:
        for pulls_ahead in ranks.values():
            pulls_ahead.shutdown()
        inbox.close()


def test_a_request_that_queues_past_its_lease_finds_it_kept_and_pulls_at_once(served):
    """A request admitted ahead arrives and waits for blocks (decode's queue) longer than its
    producer's leases last (1 s here). Its lease is looked up from its arrival and renewed while
    it waits (a real LeaseMessages, over gRPC), so the producer still holds it past its first
    expiry, and once the blocks are allocated the pull starts at once, into those blocks, with
    the prefill's token told. (Looked up only once its blocks were allocated, as before, the
    lease had expired by then and the request was aborted.)"""
    producer, server, client = served
    messages = LeaseMessages(
        KVTransferSettings(secret=SECRET, lease_seconds=1),
        "decode-0",
        lambda p: p.remote_endpoints[0],
        lambda *a: client,
    )
    pulls: list[PullSpec] = []
    pulls_ahead = ahead_pulls(lambda endpoint: client, pulls, hold=messages.hold)
    key = "1" * 32
    arrived = awaiting("r-1", key, server.address)
    try:
        pulls_ahead.queue(PullSpec("r-1", None, (), (), awaiting=arrived.awaiting))  # no blocks yet
        params = KVParams("prefill-0", "req-1", (server.address,), (3,), 100, time.time() + 1, remote_lease_seconds=1)
        expiry = time.monotonic() + 1
        producer.leases.add("req-1", [3], expiry, key=key, handout=(json.dumps(params.signed(PARAMS_KEY).to_dict()), 9))
        wait_until(lambda: messages.kept_until(params) > 0, "the lease found while queued is renewed")
        wait_until(lambda: time.monotonic() > expiry + 0.5, "the lease's first expiry is past")
        producer.leases.collect_finished()  # what the producer's engine does every step
        assert len(producer.leases) == 1  # renewed: still held
        assert pulls == []  # no blocks yet, no pull
        pulls_ahead.add(arrived)  # the blocks are allocated
        [pull] = pulls
        assert (pull.request_id, pull.remote.remote_request_id, pull.local_block_ids) == ("r-1", "req-1", (5,))
        assert pulls_ahead.take_first_tokens() == {"r-1": 9}
    finally:
        pulls_ahead.shutdown()
        messages.shutdown()


@pytest.mark.parametrize("ends", ["forsaken", "abandoned"])
def test_a_lease_found_while_its_request_queued_is_released_when_it_ends_unpulled(served, ends):
    """The request ends in decode's queue (forsaken), or vLLM declines its load (abandoned with no
    pull planned), after its lease was found: the lease is released, not renewed to no end."""
    producer, server, client = served
    held: list[KVParams] = []

    def release(lease: KVParams) -> None:
        client.release(lease.remote_request_id, transferred=False, engine_id="decode-0", timeout_s=5)

    pulls: list[PullSpec] = []
    pulls_ahead = ahead_pulls(lambda endpoint: client, pulls, release, hold=held.append)
    arrived = awaiting("r-1", "1" * 32, server.address)
    try:
        pulls_ahead.queue(arrived)
        producer.leases.add("req-1", [3], time.monotonic() + 60, key="1" * 32, handout=lease("req-1", 9))
        wait_until(lambda: len(held) == 1, "the lease found while queued is held")
        if ends == "forsaken":
            pulls_ahead.forsake(arrived)
        else:
            pulls_ahead.abandon("r-1")
        wait_until(lambda: len(producer.leases) == 0, "the lease is released")
        assert pulls == [] and pulls_ahead.take_first_tokens() == {}
    finally:
        pulls_ahead.shutdown()


@pytest.mark.parametrize("state", ["queued", "awaiting", "forsaken"])
def test_a_key_whose_prefill_stopped_at_its_first_token_ends_its_lookup(served, monkeypatch, state):
    """The prefill stopped at its first token (the router answers the request from it: the
    producer files no lease). A request sent ahead under that key, queued, awaiting with blocks,
    or already ended (forsaken), was looked up until its deadline (here 10 min), one held call
    after another. The producer now says that none comes: the lookup ends at once, and a request
    still here is aborted (the router ends it too) without waiting for its deadline."""
    monkeypatch.setattr(ahead, "LOOKUP_HOLD_S", HOLD_S)
    producer, server, client = served
    inbox = FailureInbox(on_abort=(aborted := []).append)  # the engine's API process: aborts
    monkeypatch.setenv(FAILURE_SOCKET_ENV, inbox.path)
    pulls: list[PullSpec] = []
    pulls_ahead = ahead_pulls(lambda endpoint: client, pulls)
    arrived = awaiting("r-1", "1" * 32, server.address)
    try:
        {"queued": pulls_ahead.queue, "awaiting": pulls_ahead.add, "forsaken": pulls_ahead.forsake}[state](arrived)
        wait_until(lambda: server.lookups_held == 1, "the key's lookup is held")
        producer.leases.none_comes("1" * 32, 7)  # what the producer's worker files for such a prefill
        wait_until(lambda: not pulls_ahead._lookups, "the lookup ends")
        assert server.lookups_held == 0 and pulls == [] and pulls_ahead.take_first_tokens() == {}
        if state != "forsaken":
            wait_until(lambda: aborted == ["r-1"], "the request is aborted")
    finally:
        pulls_ahead.shutdown()
        inbox.close()
    assert aborted == ([] if state == "forsaken" else ["r-1"])
