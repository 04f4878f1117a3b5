"""The mooncake backend's own rules, with Mooncake's real transfer engine over TCP on 127.0.0.1,
producer and consumer in two processes: byte-exact pulls read in place and staged (a cache whose
layers are not contiguous rows takes the staged read a device cache takes:
tools/kv_mooncake_device_check.py runs it on CUDA), one descriptor per run of blocks, a producer
without Mooncake named with both sides, a stalled producer and a failing read are failed loads,
the producer holds the lease for the whole read, short runs of blocks are read staged, and a read
past its deadline is reported only once Mooncake ended it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdcluster.errors import HandshakeError, KVTransferError, LeaseNotFoundError, TransferTimeoutError
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport, serve_backends
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.kv_transfer.transports.mooncake import in_place, mean_run_bytes
from pdcluster.kv_transfer.transports.mooncake_engine import (
    BATCH_PENDING,
    MAX_BATCH,
    MooncakeEngine,
    build,
    descriptors,
    engine_for,
    registers,
    unavailable,
)
from tests.unit.kv_fixtures import make_cache
from tests.unit.kv_producer import CHUNK, REQUESTS, assert_copied, pull, running_producer, settings

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
BACKENDS = ("grpc", "mooncake")


@pytest.fixture(scope="module")
def producer_process():
    with running_producer(BACKENDS) as producer:
        yield producer


@pytest.fixture(scope="module")
def strided_producer():
    with running_producer(BACKENDS, strided=True) as producer:
        yield producer


@pytest.mark.parametrize("request_id", ["req-a", "req-b"])
def test_pull_copies_blocks_exactly(producer_process, request_id):
    address, _ = producer_process
    dst_ids = [50 - i for i in range(len(REQUESTS[request_id]))]
    consumer, nbytes = pull("mooncake", address, request_id, dst_ids, direct=True)
    assert nbytes == len(dst_ids) * consumer.layout.bytes_per_block()
    assert_copied(consumer, request_id, dst_ids)


@pytest.mark.parametrize(
    ("producer_strided", "consumer_strided"),
    [(True, False), (False, True), (True, True)],
    ids=["staged-producer", "landing-consumer", "both"],
)
@pytest.mark.parametrize("direct", [True, False], ids=["cache-sink", "plain-sink"])
def test_a_cache_not_readable_in_place_is_read_staged_exactly(
    producer_process, strided_producer, producer_strided, consumer_strided, direct
):
    """A producer whose layers are not contiguous rows serves each chunk from a registered slot
    (it advertises no layer addresses); a consumer whose cache Mooncake cannot write in place (or
    a sink that offers no cache) lands each chunk in a registered buffer and hands it on in
    pieces its scatterer's slots hold. req-b's 20 blocks of 1 KiB a layer in 12 KiB staged
    chunks: 6 chunks through 2 slots, each slot refilled after its chunk was read."""
    address, _ = strided_producer if producer_strided else producer_process
    client = create_transport("mooncake", settings()).connect(address)
    try:
        client.handshake(make_cache().layout, "decode-0")
        assert bool(client.handshake_reply.mooncake_layer_addresses) is not producer_strided
        assert client.handshake_reply.mooncake_staging
    finally:
        client.close()
    dst_ids = [50 - i for i in range(len(REQUESTS["req-b"]))]
    consumer, nbytes = pull("mooncake", address, "req-b", dst_ids, direct=direct, strided=consumer_strided)
    assert nbytes == len(dst_ids) * consumer.layout.bytes_per_block()
    assert_copied(consumer, "req-b", dst_ids)


@pytest.mark.parametrize(
    ("floor", "request_id", "dst_ids", "mode"),
    [
        (None, "req-b", [59 - i for i in range(20)], "landed"),  # tcp's 1 MiB; runs of 1 KiB
        (0, "req-b", [59 - i for i in range(20)], "in_place"),
        (4096, "req-b", list(range(40, 60)), "in_place"),  # one run of 20 KiB a layer
        (4096, "req-a", list(range(40, 45)), "staged"),  # producer's runs 1/3/1; ours one of 5 KiB
    ],
    ids=["default-scattered", "floor-0", "long-run", "short-producer-runs"],
)
def test_short_runs_are_read_staged_and_scattered_only_where_short(producer_process, floor, request_id, dst_ids, mode):
    """Over TCP Mooncake pays per descriptor, and a fragmented cache makes one per block and
    layer: a pull whose runs (consecutive on both sides) average under the floor is gathered into
    chunks on the producer, read one descriptor a chunk, straight into our rows where our own
    runs reach the floor, else into a landing buffer scattered into our blocks."""
    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport("mooncake", settings(mooncake={"in_place_min_run_bytes": floor})).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        client.pull(request_id, REQUESTS[request_id], sink_for(consumer, dst_ids), engine_id="d", timeout_s=20)
        assert dict(client.reads) == {mode: 1}
    finally:
        client.close()
    assert_copied(consumer, request_id, dst_ids)


def test_the_in_place_floor_is_mean_bytes_per_descriptor_and_off_with_rdma():
    rows = [1024, 3072]  # 2 KiB a block on average
    assert mean_run_bytes(rows, [3, 4, 5, 9], [10, 11, 12, 13]) == 4 * 2048 / 2
    assert mean_run_bytes(rows, [3, 4, 5, 9]) == 4 * 2048 / 2
    assert mean_run_bytes(rows, [1, 2, 3], [7, 6, 5]) == 2048
    assert mean_run_bytes(rows, []) == float("inf")
    assert settings(mooncake={"in_place_min_run_bytes": None}).mooncake.run_floor() == 1 << 20
    assert settings(mooncake={"in_place_min_run_bytes": None, "protocol": "rdma"}).mooncake.run_floor() == 0
    assert settings(mooncake={"in_place_min_run_bytes": 5, "protocol": "rdma"}).mooncake.run_floor() == 5


def test_unknown_request_is_not_found(producer_process):
    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport("mooncake", settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        with pytest.raises(LeaseNotFoundError):
            client.pull("nope", [1], sink_for(consumer, [1]), engine_id="decode-0", timeout_s=20)
    finally:
        client.close()


def test_one_descriptor_per_run_of_blocks_consecutive_on_both_sides():
    # Producer blocks 3, 4, 5 into consumer 10, 11, 12 (one run); 9 into 13 (a break on the
    # producer's side); 10 into 20 (a break on ours). Two layers of 100 and 50 bytes per block.
    local, remote, lengths = descriptors([1000, 9000], [5000, 7000], [100, 50], [3, 4, 5, 9, 10], [10, 11, 12, 13, 20])
    assert local == [2000, 2300, 3000, 9500, 9650, 10000]
    assert remote == [5300, 5900, 6000, 7150, 7450, 7500]
    assert lengths == [300, 100, 100, 150, 50, 50]
    assert descriptors([1], [2], [3], [], []) == ([], [], [])
    with pytest.raises(KVTransferError, match="2 producer blocks for 1 consumer blocks"):
        descriptors([1], [2], [3], [1, 2], [1])


def test_device_memory_is_read_in_place_only_with_a_build_that_registers_it():
    """The lock file's wheel is Mooncake's non-CUDA build: host caches in place, CUDA and NPU
    caches staged (its CUDA and NPU wheels register device memory: the H200 check)."""
    assert build() == "mooncake-transfer-engine-non-cuda"
    assert registers("cpu") and not registers("cuda") and not registers("npu")
    host = make_cache().tensors
    assert in_place(host, settings())
    assert not in_place(make_cache(strided=True).tensors, settings())
    on_device = [t.to("meta") for t in host]  # a device this build cannot read
    for choice in ("auto", "register", "stage"):
        assert not in_place(on_device, settings(mooncake={"device_memory": choice}))


def test_a_region_stays_registered_until_its_last_holder_lets_go():
    """Two servers over one cache in one process (a KV server restarted before the old one
    closed): the old one's close must not unregister what the new one serves."""
    engine = engine_for("producer", "127.0.0.1", settings())
    buffer = torch.empty(1 << 16, dtype=torch.uint8)
    region = [(buffer.data_ptr(), buffer.numel())]
    old, new = object(), object()
    engine.register(region, old)
    engine.register(region, new)
    engine.unregister(region, old)
    assert region[0] in engine._registered
    engine.unregister(region, new)
    assert region[0] not in engine._registered


def sink_for(consumer, dst_ids, after_chunk=None) -> CacheSink:
    scatterer = BlockScatterer(consumer, CHUNK)
    scatterer.begin(dst_ids)
    return CacheSink(scatterer, after_chunk)


def test_a_producer_without_mooncake_is_named_with_both_sides():
    producer = KVProducer(make_cache(), "prefill-plain", max_chunk_bytes=CHUNK)
    producer.leases.add("r", [1, 2], time.monotonic() + 60)
    server = serve_backends(["grpc"], settings(), producer, "127.0.0.1", 0)
    consumer = make_cache(fill="zeros")
    client = create_transport("mooncake", settings()).connect(server.address)
    try:
        client.handshake(consumer.layout, "decode-0")
        with pytest.raises(HandshakeError, match="prefill-plain describes 0 Mooncake layer regions .* needs 3"):
            client.pull("r", [1, 2], sink_for(consumer, [5, 6]), engine_id="decode-0", timeout_s=10)
    finally:
        client.close()
        server.stop(0)


def test_a_stalled_producer_is_a_timed_out_pull_and_the_next_pull_works():
    faults = {"serve_delay_s": 3.0, "serve_delay_rate": 0.5, "seed": 1}
    with running_producer(BACKENDS, fault_injection=faults) as (address, _):
        consumer = make_cache(fill="zeros")
        client = create_transport("mooncake", settings()).connect(address)
        try:
            client.handshake(consumer.layout, "decode-0")
            outcomes = []
            for request_id, dst in (
                ("req-a", [50, 49, 48, 47, 46]),
                ("req-c", [30, 31]),
                ("req-b", list(range(40, 60))),
            ):
                try:
                    client.pull(request_id, REQUESTS[request_id], sink_for(consumer, dst), engine_id="d", timeout_s=1)
                    assert_copied(consumer, request_id, dst)
                    outcomes.append("ok")
                except KVTransferError as exc:
                    assert "deadline" in str(exc).lower() or "timed out" in str(exc).lower(), exc
                    outcomes.append("timed out")
        finally:
            client.close()
    assert sorted(set(outcomes)) == ["ok", "timed out"], outcomes  # seed 1: both happen


@pytest.mark.parametrize("strided", [False, True], ids=["in-place", "staged"])
def test_a_failing_read_fails_the_pull_and_the_producer_lets_go_of_the_lease(strided):
    def fail(chunk):
        raise KVTransferError("injected: the sink refused a chunk")

    with running_producer(BACKENDS, strided=strided) as (address, conn):
        consumer = make_cache(fill="zeros")
        client = create_transport("mooncake", settings()).connect(address)
        try:
            client.handshake(consumer.layout, "decode-0")
            with pytest.raises(KVTransferError, match="injected"):
                client.pull("req-c", REQUESTS["req-c"], sink_for(consumer, [7, 8], fail), engine_id="d", timeout_s=10)
            # The lease is not held by a pull any more: it can be read again, and released.
            client.pull("req-c", REQUESTS["req-c"], sink_for(consumer, [7, 8]), engine_id="d", timeout_s=10)
            assert_copied(consumer, "req-c", [7, 8])
            assert client.release("req-c", transferred=True, engine_id="d", timeout_s=5)
        finally:
            client.close()
        conn.send("released")
        assert conn.recv() == ["req-c"]


def test_a_restarted_producer_is_asked_for_its_new_regions():
    """Same endpoint, new process: its session, transfer engine and cache addresses are new; the
    client's next pull opens a new session, asks for them again, and reads exactly."""
    with running_producer(BACKENDS) as (address, _):
        port = int(address.rsplit(":", 1)[1])
    consumer = make_cache(fill="zeros")
    client = create_transport("mooncake", settings()).connect(f"127.0.0.1:{port}")
    try:
        for generation in range(2):
            with running_producer(BACKENDS, port=port):
                if generation == 0:
                    client.handshake(consumer.layout, "decode-0")
                dst = [20 + 5 * generation, 21 + 5 * generation]
                client.pull("req-c", REQUESTS["req-c"], sink_for(consumer, dst), engine_id="d", timeout_s=10)
                assert_copied(consumer, "req-c", dst)
    finally:
        client.close()


def test_a_pull_of_more_ranges_than_mooncake_queues_per_peer_is_read_in_batches():
    """Every other block, 8 layers: 4096 ranges (Mooncake's TCP transport fails a batch of more
    than 2048 to one peer as a whole), read exactly."""
    source = make_cache(num_blocks=1100, layers=8, seed=3)
    producer = KVProducer(source, "prefill-wide", max_chunk_bytes=CHUNK)
    remote_ids = list(range(0, 1024, 2))
    producer.leases.add("wide", remote_ids, time.monotonic() + 60)
    server = serve_backends(["mooncake"], settings(), producer, "127.0.0.1", 0)
    consumer = make_cache(num_blocks=1100, layers=8, fill="zeros")
    local_ids = list(range(1, 1025, 2))
    client = create_transport("mooncake", settings()).connect(server.address)
    try:
        client.handshake(consumer.layout, "decode-0")
        client.pull("wide", remote_ids, sink_for(consumer, local_ids), engine_id="decode-0", timeout_s=30)
    finally:
        client.close()
        server.stop(0)
    assert len(remote_ids) * len(source.tensors) > MAX_BATCH
    for src, dst in zip(source.tensors, consumer.tensors):
        assert torch.equal(dst[local_ids], src[remote_ids])


class EndingLate:
    """Mooncake's transfer engine as it behaves when a peer stalls mid-read (which loopback here
    cannot show: a stopped peer's bytes are still read): the batch stays pending until the engine
    ends it, failed, `pending_s` after its start (its own transfer timeout)."""

    def __init__(self, pending_s: float):
        self.pending_s, self.started, self.polls_after_end = pending_s, 0.0, 0

    def batch_transfer_async_read(self, session, local, remote, lengths):
        self.started = time.monotonic()
        return 1

    def get_batch_transfer_status(self, batches):
        if time.monotonic() < self.started + self.pending_s:
            return BATCH_PENDING
        self.polls_after_end += 1
        return -1

    def ended(self) -> bool:
        return self.polls_after_end > 0


def test_a_read_past_its_deadline_is_reported_only_once_mooncake_ended_it():
    """The deadline passes (and a grace period more) with the read in flight; Mooncake ends it
    later, by its own timeout. The read fails only then: its failure frees the consumer's blocks
    for vLLM (or a landing buffer) to reuse, which a read given up on in flight could still write
    (it was given up a grace period after the deadline)."""
    engine = MooncakeEngine.__new__(MooncakeEngine)  # its batching and waiting, on the stand-in
    engine.engine, engine.transfer_timeout_s = EndingLate(pending_s=1.0), 2.0
    engine._lock, engine._peers, engine._wedged = threading.Lock(), {}, set()
    with pytest.raises(KVTransferError, match="failed"):
        engine.read("peer:1", [1], [2], [3], deadline=time.monotonic() + 0.1, grace_s=0.3)
    assert engine.engine.ended()


class Released(EndingLate):
    """A batch that stays pending, past Mooncake's own timeout, until the test lets it end."""

    def __init__(self):
        super().__init__(pending_s=0)
        self.go, self.submitted = threading.Event(), 0

    def batch_transfer_async_read(self, session, local, remote, lengths):
        self.submitted += 1
        return super().batch_transfer_async_read(session, local, remote, lengths)

    def get_batch_transfer_status(self, batches):
        return BATCH_PENDING if not self.go.is_set() else super().get_batch_transfer_status(batches)


def test_a_read_mooncake_leaves_running_past_its_timeout_is_awaited_and_its_peer_gets_no_read():
    """Mooncake's own timeout and the grace period pass with the batch still pending: the read
    is not given up on (its bytes could still land in memory reused since), and until it ends its
    peer gets no new read: another pull fails at once, submitting nothing; so does one that would
    wait past its deadline behind a read in flight. Once it ends, the peer is read again."""
    engine = MooncakeEngine.__new__(MooncakeEngine)
    engine.engine, engine.transfer_timeout_s = Released(), 0.2
    engine._lock, engine._peers, engine._wedged = threading.Lock(), {}, set()
    errors: list[Exception] = []

    def first() -> None:
        try:
            engine.read("peer:1", [1], [2], [3], deadline=time.monotonic() + 0.1, grace_s=0.1)
        except KVTransferError as exc:
            errors.append(exc)

    reader = threading.Thread(target=first)
    reader.start()
    with pytest.raises(TransferTimeoutError, match="held it past the pull's deadline"):
        engine.read("peer:1", [1], [2], [3], deadline=time.monotonic() + 0.05, grace_s=0.1)
    end = time.monotonic() + 20
    while "peer:1" not in engine._wedged:
        assert time.monotonic() < end, "the overdue read was not noticed"
        time.sleep(0.01)  # poll interval
    time.sleep(0.3)
    assert reader.is_alive() and not errors  # awaited, well past its deadline and the timeout
    with pytest.raises(KVTransferError, match="no read goes there until it ends"):
        engine.read("peer:1", [1], [2], [3], deadline=time.monotonic() + 5, grace_s=0.1)
    assert engine.engine.submitted == 1  # neither of the others submitted a batch
    engine.engine.go.set()
    reader.join(20)
    assert len(errors) == 1 and "failed" in str(errors[0])
    with pytest.raises(KVTransferError, match="failed"):  # read again (this stand-in fails every batch)
        engine.read("peer:1", [1], [2], [3], deadline=time.monotonic() + 5, grace_s=0.1)
    assert engine.engine.submitted == 2
