"""The gRPC transport over real sockets on 127.0.0.1: pulls, auth, handshake, leases."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from pdcluster.errors import AuthenticationError, HandshakeError, KVTransferError, LeaseExpiredError, LeaseNotFoundError
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION, layout_digest
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport, rpc
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.support.raw_grpc import refused_raw_pull
from tests.unit.kv_fixtures import make_cache

SECRET = "s3cret-for-tests"


@pytest.fixture
def producer_server():
    cache = make_cache()
    producer = KVProducer(cache, "prefill-0", max_chunk_bytes=4096, lease_wait_s=0.5)
    transport = create_transport("grpc", KVTransferSettings(secret=SECRET, max_chunk_bytes=4096))
    server = transport.serve(producer, "127.0.0.1", 0)
    yield producer, server, transport
    server.stop(0)


def pull_into(transport, server, consumer_cache, request_id, src_ids, dst_ids):
    client = transport.connect(server.address)
    try:
        client.handshake(consumer_cache.layout, "decode-0")
        scatterer = BlockScatterer(consumer_cache, 4096)
        scatterer.begin(dst_ids)
        return client.pull(request_id, src_ids, scatterer.write, engine_id="decode-0", timeout_s=10), client.release(
            request_id, transferred=True, engine_id="decode-0", timeout_s=5
        )
    finally:
        client.close()


def test_pull_copies_blocks_and_release_frees_the_lease(producer_server):
    producer, server, transport = producer_server
    src_ids, dst_ids = [3, 9, 10, 11, 60], [1, 2, 3, 50, 4]
    producer.leases.add("req-1", src_ids, time.monotonic() + 30)
    consumer = make_cache(fill="zeros")
    nbytes, released = pull_into(transport, server, consumer, "req-1", src_ids, dst_ids)
    assert nbytes == len(src_ids) * consumer.layout.bytes_per_block()
    assert released
    for src, dst in zip(producer.cache.tensors, consumer.tensors):
        assert torch.equal(dst[dst_ids], src[src_ids])
    finished = producer.leases.collect_finished()
    assert [(lease.request_id, lease.expired, lease.transferred) for lease in finished] == [("req-1", False, True)]


def test_a_release_that_comes_before_its_lease_is_filed_ends_the_lease_once_filed(producer_server):
    """Where the producer's worker hears of a lease a step after its scheduler signed it (a
    worker process of its own, async scheduling), decode may release it first (a full local
    prefix hit, a request dropped before its pull): the release is kept, and the lease ends the
    moment it is filed instead of holding its blocks until it expires."""
    producer, server, transport = producer_server
    client = transport.connect(server.address)
    try:
        client.handshake(make_cache(fill="zeros").layout, "decode-0")
        assert client.release("req-early", transferred=False, engine_id="decode-0", timeout_s=5)
    finally:
        client.close()
    producer.leases.add("req-early", [4, 5], time.monotonic() + 600)  # the worker's next step
    finished = producer.leases.collect_finished()
    assert [(lease.request_id, lease.expired, lease.transferred) for lease in finished] == [("req-early", False, False)]
    assert len(producer.leases) == 0
    with pytest.raises(LeaseExpiredError):
        producer.leases.acquire("req-early", [4, 5], wait_s=0)


def test_pull_may_ask_for_a_suffix_of_the_lease(producer_server):
    producer, server, transport = producer_server
    producer.leases.add("req-2", [7, 8, 9, 10], time.monotonic() + 30)
    consumer = make_cache(fill="zeros")
    pull_into(transport, server, consumer, "req-2", [9, 10], [0, 1])
    for src, dst in zip(producer.cache.tensors, consumer.tensors):
        assert torch.equal(dst[[0, 1]], src[[9, 10]])


def test_blocks_outside_the_lease_are_refused(producer_server):
    producer, server, transport = producer_server
    producer.leases.add("req-3", [1, 2], time.monotonic() + 30)
    with pytest.raises(LeaseNotFoundError, match="does not hold blocks"):
        pull_into(transport, server, make_cache(fill="zeros"), "req-3", [1, 2, 3], [0, 1, 2])


def test_unknown_request_is_not_found_after_bounded_wait(producer_server):
    _, server, transport = producer_server
    with pytest.raises(LeaseNotFoundError, match="no KV lease"):
        pull_into(transport, server, make_cache(fill="zeros"), "nope", [1], [1])


def test_pull_waits_for_a_lease_registered_a_moment_later(producer_server):
    producer, server, transport = producer_server
    consumer = make_cache(fill="zeros")
    registered = threading.Event()

    def register():
        registered.wait(5)
        producer.leases.add("late", [4, 5], time.monotonic() + 30)

    thread = threading.Thread(target=register)
    thread.start()
    client = transport.connect(server.address)
    client.handshake(consumer.layout, "decode-0")
    scatterer = BlockScatterer(consumer, 4096)
    scatterer.begin([0, 1])
    registered.set()  # the pull below starts waiting while the lease is being added
    client.pull("late", [4, 5], scatterer.write, engine_id="decode-0", timeout_s=10)
    thread.join()
    client.close()
    assert torch.equal(consumer.tensors[0][[0, 1]], producer.cache.tensors[0][[4, 5]])


def test_wrong_secret_is_refused_and_gets_no_bytes(producer_server):
    producer, server, _ = producer_server
    producer.leases.add("req-4", [1, 2], time.monotonic() + 30)
    intruder = create_transport("grpc", KVTransferSettings(secret="wrong"))
    client = intruder.connect(server.address)
    with pytest.raises(AuthenticationError, match="UNAUTHENTICATED"):
        client.handshake(make_cache(fill="zeros").layout, "intruder")
    client.close()


def test_raw_grpc_client_without_secret_gets_nothing(producer_server):
    """A hand-rolled client (no pdcluster code on its side) cannot read a leased block."""
    producer, server, _ = producer_server
    producer.leases.add("req-5", [1, 2], time.monotonic() + 30)
    request = pb.PullRequest(
        protocol_version=PROTOCOL_VERSION,
        request_id="req-5",
        block_ids=[1, 2],
        layout_digest=layout_digest(producer.layout),
    )
    assert refused_raw_pull(server.address, request, 5) == grpc.StatusCode.UNAUTHENTICATED
    # The lease is untouched: the legitimate consumer can still pull it.
    assert len(producer.leases) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(block_size=32), r"block_size: prefill \(producer\) has 16, decode \(consumer\) has 32"),
        (dict(model="other-model"), r"model: prefill \(producer\) has 'tiny', decode \(consumer\) has 'other-model'"),
        (dict(layers=4), "layer names"),
        (dict(dtype=torch.float16), "dtype of layer model.layers.0.self_attn.attn"),
    ],
)
def test_handshake_mismatch_names_both_sides(producer_server, change, message):
    _, server, transport = producer_server
    consumer = make_cache(fill="zeros", **change)
    client = transport.connect(server.address)
    with pytest.raises(HandshakeError, match=message):
        client.handshake(consumer.layout, "decode-0")
    client.close()


def test_lease_expires_when_nobody_pulls():
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096)
    now = time.monotonic()
    producer.leases.add("idle", [1, 2, 3], now + 5)
    assert producer.leases.collect_finished(now + 4) == []
    (lease,) = producer.leases.collect_finished(now + 5)
    assert lease.request_id == "idle" and lease.expired
    assert producer.leases.collect_finished(now + 100) == []


def test_lease_is_never_freed_mid_transfer():
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=1024)
    now = time.monotonic()
    producer.leases.add("busy", list(range(8)), now + 1)
    digest = layout_digest(producer.layout)
    stream = producer.stream("busy", list(range(8)), remote_version=PROTOCOL_VERSION, remote_digest=digest)
    next(stream)  # transfer in progress
    assert producer.leases.collect_finished(now + 10) == []  # past its deadline, still held
    assert producer.release("busy", transferred=True)
    assert producer.leases.collect_finished(now + 10) == []  # release waits for the pull to end
    for _ in stream:
        pass
    (lease,) = producer.leases.collect_finished(now + 10)
    assert lease.request_id == "busy" and not lease.expired


def test_unknown_transport_name_lists_the_available_ones():
    with pytest.raises(ValueError, match="available: collective, grpc, mooncake, shm"):
        create_transport("carrier-pigeon", KVTransferSettings(secret="x"))


def test_a_producer_that_names_no_offers_is_served_over_grpc():
    """A producer from before the handshake named its offers (an older pdcluster beside this
    one, the same protocol version) answers with none: the consumer takes the grpc every
    producer serves instead of refusing to pull."""
    from pdcluster.kv_transfer.transports.grpc_transport import GrpcServer
    from pdcluster.kv_transfer.transports.selection import choose_backend, node_id

    producer = KVProducer(make_cache(), "prefill-old", max_chunk_bytes=4096)
    settings = KVTransferSettings(secret=SECRET, max_chunk_bytes=4096)
    server = GrpcServer(producer, "127.0.0.1", 0, settings, offers=())
    client = create_transport("grpc", settings).connect(server.address)
    try:
        info = client.handshake(make_cache(fill="zeros").layout, "decode-0")
    finally:
        client.close()
        server.stop(0)
    assert info.offers == ("grpc",)
    chosen = choose_backend(
        "auto",
        local_node=node_id(),
        local_device="cpu",
        remote_node=info.node_id,
        remote_device=info.device_kind,
        remote_offers=info.offers,
    )
    assert chosen == "grpc"


@pytest.mark.parametrize("ending", ["expired", "was released"])
def test_a_pull_for_an_ended_lease_fails_at_once(ending):
    """The producer remembers leases that ended: a late pull is refused at once, not after a
    wait for the lease to appear (which would hold a server thread: here it would outlast the
    pull's own deadline and end as a timeout instead)."""
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096, lease_wait_s=600)
    transport = create_transport("grpc", KVTransferSettings(secret=SECRET, max_chunk_bytes=4096, server_threads=1))
    server = transport.serve(producer, "127.0.0.1", 0)
    try:
        if ending == "expired":
            producer.leases.add("req-late", [1, 2], time.monotonic() - 1)
        else:
            producer.leases.add("req-late", [1, 2], time.monotonic() + 600)
            producer.release("req-late", True)
        assert [lease.request_id for lease in producer.leases.collect_finished()] == ["req-late"]
        consumer = make_cache(fill="zeros")
        for _ in range(3):  # one server thread: a waiting pull would block the next
            with pytest.raises(LeaseNotFoundError, match=f"req-late {ending}"):
                pull_into(transport, server, consumer, "req-late", [1, 2], [0, 1])
    finally:
        server.stop(0)


def test_renewals_keep_queued_leases_and_skip_ended_ones(producer_server):
    producer, server, transport = producer_server
    producer.lease_seconds = 600
    producer.leases.add("req-q", [1, 2], time.monotonic() + 1)
    producer.leases.add("req-r", [3], time.monotonic() + 600)
    producer.release("req-r", True)
    client = transport.connect(server.address)
    try:
        client.handshake(make_cache(fill="zeros").layout, "decode-0")
        assert client.renew(["req-q", "req-r", "req-unknown"], engine_id="decode-0", timeout_s=5) == 1
    finally:
        client.close()
    # Past its first deadline the renewed lease is still held; the released one is not.
    assert [lease.request_id for lease in producer.leases.collect_finished(time.monotonic() + 2)] == ["req-r"]
    assert len(producer.leases) == 1


def test_a_lease_filed_under_a_key_is_handed_out_by_it_also_after_it_ended(producer_server):
    """Handouts (router.decode_ahead): a consumer that never knew the producer's request id finds
    the signed lease and the first token by the router's key; only keys with a registered lease
    answer; an ended lease still hands out its first token (the pull then fails as for any)."""
    producer, server, transport = producer_server
    client = transport.connect(server.address)
    try:
        client.handshake(make_cache(fill="zeros").layout, "decode-0")
        lookup = {"engine_id": "decode-0", "wait_s": 0.0, "timeout_s": 5}
        assert client.handouts(["a" * 32], **lookup) == {}
        producer.leases.add("req-1", [3], time.monotonic() + 30, key="a" * 32, handout=('{"lease": 1}', 42))
        producer.leases.add("req-2", [4], time.monotonic() + 30)  # filed under no key
        assert client.handouts(["a" * 32, "b" * 32], **lookup) == {"a" * 32: ('{"lease": 1}', 42)}
        assert client.release("req-1", transferred=True, engine_id="decode-0", timeout_s=5)
        assert [lease.request_id for lease in producer.leases.collect_finished()] == ["req-1"]
        assert client.handouts(["a" * 32], **lookup) == {"a" * 32: ('{"lease": 1}', 42)}
    finally:
        client.close()


def test_a_lookup_held_by_the_producer_returns_as_the_lease_comes():
    """The producer holds a lookup while none of its keys has a lease, and answers as soon as one
    is registered (the registration below happens while the lookup waits: it is what ends it)."""
    from pdcluster.kv_transfer.leases import LeaseTable

    table = LeaseTable()
    found: list[dict] = []
    waiting = threading.Thread(target=lambda: found.append(table.handouts(["c" * 32], wait_s=30)))
    waiting.start()
    table.add("req-3", [1], time.monotonic() + 30, key="c" * 32, handout=("{}", 7))
    waiting.join(30)
    assert found == [{"c" * 32: ("{}", 7)}]
    assert table.handouts(["d" * 32], wait_s=0.01) == {}  # a key never filed: empty after the hold


def test_the_server_says_when_calls_take_all_its_threads(caplog, monkeypatch):
    """A pull waiting for its lease holds the server's only thread: the server says which calls
    hold them all (the next calls wait); after the pull ends, nothing more is in progress."""
    monkeypatch.setattr(rpc, "BUSY_WARNING_INTERVAL_S", 0.0)  # every time (the handshake's too)
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096, lease_wait_s=60)
    transport = create_transport("grpc", KVTransferSettings(secret=SECRET, max_chunk_bytes=4096, server_threads=1))
    server = transport.serve(producer, "127.0.0.1", 0)
    try:
        consumer = make_cache(fill="zeros")
        pulled = []
        puller = threading.Thread(target=lambda: pulled.append(pull_into(transport, server, consumer, "r", [1], [0])))
        with caplog.at_level("WARNING", logger="pdcluster.kv_transfer.transports.rpc"):
            puller.start()
            deadline = time.monotonic() + 30
            while "take all 1 of its threads (Pull 1)" not in caplog.text:
                assert time.monotonic() < deadline, f"no busy warning: {caplog.text!r}"
                time.sleep(0.01)  # poll interval
        producer.leases.add("r", [1], time.monotonic() + 600)
        puller.join(30)
        assert pulled and pulled[0][1]  # pulled, then released
        while +server.authorizer.busy:  # each call leaves the count as it ends
            assert time.monotonic() < deadline + 30, f"calls left in progress: {server.authorizer.busy}"
            time.sleep(0.01)  # poll interval
    finally:
        server.stop(0)


class _CannotStart:
    """A registered backend whose server side cannot start (as a Mooncake engine that fails)."""

    def __init__(self, settings, device="cpu"):
        pass

    def server_extension(self, producer, host):
        raise KVTransferError("this backend cannot start here")


def test_a_backend_that_cannot_start_fails_the_server_at_once_and_leaks_nothing():
    """A backend's server side fails to start: the backends started before it are closed (shm's
    peer thread and socket once stayed), and the worker's port search stops there with that
    reason (it once tried every port of the range, building and leaking them each time, and then
    said "no free KV port")."""
    from types import SimpleNamespace

    from pdcluster.kv_transfer import transports
    from pdcluster.kv_transfer.worker import ConnectorWorker

    if "cannot-start" not in transports.available_transports():
        transports.register_transport("cannot-start", f"{__name__}:_CannotStart")
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096, lease_wait_s=0.5)
    settings = KVTransferSettings(secret="bind-test-secret", port_range=(47100, 47163), bind_host="127.0.0.1")

    def peer_threads() -> int:
        return sum(t.name == "kv-shm-peers" and t.is_alive() for t in threading.enumerate())

    before = peer_threads()
    worker = SimpleNamespace(
        producer=producer, settings=settings, tp_rank=0, tp_size=1, offers=["grpc", "shm", "cannot-start"], cache=None
    )
    with pytest.raises(KVTransferError, match="^this backend cannot start here$"):
        ConnectorWorker._bind_server(worker)
    deadline = time.monotonic() + 10
    while peer_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # a closed registry's thread ends at its next turn
    assert peer_threads() == before
