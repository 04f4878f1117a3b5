"""Direct shm pulls between two real processes on 127.0.0.1: the consumer copies its half of
the layers out of the producer's cache and the producer pushes the other half into the
consumer's (cross-process copies, cma.py), fenced so that no write outlives a pull. The ring
path and the collective backend: test_fast_transports.py.

A spawned producer process serves a cache with leased requests (kv_producer.py); this process
pulls through the real client into its own cache.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport, peers
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.kv_transfer.transports.shm import ONE_SIDED_MARGIN_S
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.support.cma import skip_unless_cross_process_copies
from tests.support.handoff import wait_for
from tests.support.pids import skip_unless_pids_can_be_reused, start_with_pid
from tests.unit.kv_fixtures import make_cache
from tests.unit.kv_producer import CHUNK, REQUESTS, assert_copied, consumer_main, running_producer, settings


@pytest.fixture(autouse=True)
def direct_path_allowed():
    """Every test here needs cross-process copies (elsewhere the backend uses its ring)."""
    skip_unless_cross_process_copies()


def test_direct_pulls_after_the_first_read_early_and_survive_a_stale_peer(producer_process):
    """From the second direct pull on, the consumer copies its half before the producer's notice
    arrives; a notice that disagrees with what that copy used (here: addresses made stale)
    makes the pull read again, so the blocks still arrive exactly."""
    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport("shm", settings()).connect(address)
    early = []
    real = client._read_early
    client._read_early = lambda *args: early.append(real(*args)) or early[-1]
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        for request_id, stale in (("req-a", False), ("req-b", False), ("req-c", True)):
            dst_ids = [50 - i for i in range(len(REQUESTS[request_id]))]
            if stale:
                peer = client._peer
                client._peer = pb.ShmChunk(
                    pid=peer.pid,
                    layer_addresses=[a + 2 * consumer.block_bytes[0] for a in peer.layer_addresses],
                    push_from_layer=peer.push_from_layer,
                )
            scatterer.begin(dst_ids)
            client.pull(request_id, REQUESTS[request_id], CacheSink(scatterer), engine_id="decode-0", timeout_s=20)
            assert_copied(consumer, request_id, dst_ids)
    finally:
        client.close()
    assert early[0] is None and early[1] is not None and early[2] is not None
    assert client._peer.layer_addresses != early[2].note.layer_addresses  # the stale copy was redone


def test_a_live_lease_is_read_without_asking_the_producer(producer_process):
    """Once a direct pull told the consumer the producer's addresses, a pull given its lease's
    expiry (well ahead) reads every layer itself: it makes no call to the producer, and the
    bytes arrive exactly. A lease within ONE_SIDED_MARGIN_S of its end, an unknown expiry, a
    process other than the one of the last notice, or one_sided_reads off go through the
    producer."""
    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    clients = [create_transport("shm", settings(one_sided_reads=on)).connect(address) for on in (True, False)]
    asked = [0, 0]  # ShmPull calls per client: the producer asked to hold the lease

    def counted(index, call):
        def ask(*args, **kwargs):
            asked[index] += 1
            return call(*args, **kwargs)

        return ask

    for index, client in enumerate(clients):
        client._shm_pull = counted(index, client._shm_pull)
    try:
        for client in clients:
            client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        ahead, near = time.time() + 600, time.time() + ONE_SIDED_MARGIN_S / 2
        steps = [  # (client, request, lease expiry, a stale notice's pid, served by the producer)
            (0, "req-a", ahead, 0, True),  # the first pull learns the producer's addresses
            (0, "req-b", ahead, 0, False),
            (0, "req-c", near, 0, True),
            (0, "req-a", 0.0, 0, True),
            (0, "req-b", ahead, os.getpid(), True),  # a notice naming another process
            (0, "req-c", ahead, 0, False),  # ...replaced by the producer's next notice
            (1, "req-a", ahead, 0, True),
            (1, "req-b", ahead, 0, True),
        ]
        for index, request_id, expiry, stale_pid, by_producer in steps:
            client = clients[index]
            if stale_pid:
                client._peer = pb.ShmChunk(
                    pid=stale_pid, layer_addresses=client._peer.layer_addresses, push_from_layer=1
                )
            dst_ids = [50 - i for i in range(len(REQUESTS[request_id]))]
            consumer.tensors[0].zero_()
            before, sink = asked[index], CacheSink(scatterer)
            scatterer.begin(dst_ids)
            nbytes = client.pull(
                request_id,
                REQUESTS[request_id],
                sink,
                engine_id="decode-0",
                timeout_s=20,
                lease_expiry=expiry,
            )
            assert nbytes == len(dst_ids) * consumer.layout.bytes_per_block()
            assert_copied(consumer, request_id, dst_ids)
            assert (asked[index] - before, sink.one_sided) == ((1, False) if by_producer else (0, True)), (
                index,
                request_id,
            )
    finally:
        for client in clients:
            client.close()


def test_first_direct_pulls_at_once_register_once_and_stay_direct(producer_process):
    """A consumer's first pulls from a producer often start together (its pull threads, a
    request admitted ahead of its prefill). They register its cache once: a second registration
    replaced the first one, whose proof connection then closed, so the producer forgot the
    registration a pull in flight had named, refused it, and that consumer copied every later
    pull through the shared-memory ring (~10x slower per pull, on the producer's core)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    address, _ = producer_process
    plans = {"req-a": [40, 41, 42, 43, 44], "req-b": list(range(0, 20)), "req-c": [60, 61]}

    def first_pulls_at_once(client, consumer) -> None:
        start = Barrier(len(plans))

        def one(request_id):
            scatterer = BlockScatterer(consumer, CHUNK)
            scatterer.begin(plans[request_id])
            start.wait()
            client.pull(request_id, REQUESTS[request_id], CacheSink(scatterer), engine_id="decode-0", timeout_s=20)

        with ThreadPoolExecutor(len(plans)) as pool:
            list(pool.map(one, plans))

    for _ in range(3):  # a fresh consumer each round: its first pulls race to register
        consumer = make_cache(fill="zeros")
        client = create_transport("shm", settings()).connect(address)
        try:
            client.handshake(consumer.layout, "decode-0")
            first_pulls_at_once(client, consumer)
            assert client.direct, "a direct pull was refused: the consumer fell back to the ring"
        finally:
            client.close()
        for request_id, dst_ids in plans.items():
            assert_copied(consumer, request_id, dst_ids)


def test_a_registration_beside_a_new_session_does_not_deadlock(producer_process):
    """A consumer's first direct pull registers its cache while another thread opens a new
    session (the producer restarted), whose hooks forget the registration. The registration took
    its own lock and then the session's; the new session held the session's lock and waited for
    the registration's: both threads stopped for good, and with them every later pull."""
    import threading

    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport("shm", settings()).connect(address)
    client.handshake(consumer.layout, "decode-0")
    in_hooks, registering = threading.Event(), threading.Event()

    def first_hook() -> None:  # runs first among the new session's hooks, under its lock
        in_hooks.set()
        registering.wait(timeout=2)  # the registration, if it can get this far meanwhile

    class RegisteringSink(CacheSink):
        def host_regions(self):  # read by the registration, under its lock
            registering.set()
            return super().host_regions()

    def first_pull() -> None:
        in_hooks.wait(timeout=20)
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([40, 41, 42, 43, 44])
        client.pull("req-a", REQUESTS["req-a"], RegisteringSink(scatterer), engine_id="decode-0", timeout_s=20)

    client.control.on_new_session.insert(0, first_hook)
    with client.control._lock:
        client.control._session = None  # what StaleSessionError does (rpc.ControlChannel.call)
    threads = [threading.Thread(target=client.control.session, daemon=True), threading.Thread(target=first_pull, daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "the registration and the new session deadlocked"
    try:
        assert registering.is_set() and client.direct
        assert_copied(consumer, "req-a", [40, 41, 42, 43, 44])
    finally:
        client.close()


def test_no_one_sided_read_from_a_producer_that_exited():
    """The producer's process exited (its pidfd tells): a pull of a lease still far from its
    expiry is not read out of whatever now has its pid; it fails through the producer."""
    consumer = make_cache(fill="zeros")
    scatterer = BlockScatterer(consumer, CHUNK)

    sinks: list[CacheSink] = []

    def pull(request_id: str, dst_ids: list[int]) -> int:
        scatterer.begin(dst_ids)
        sink = CacheSink(scatterer)
        sinks.append(sink)
        ahead = time.time() + 600
        return client.pull(
            request_id, REQUESTS[request_id], sink, engine_id="decode-0", timeout_s=5, lease_expiry=ahead
        )

    with running_producer() as (address, _):
        client = create_transport("shm", settings(connect_timeout_seconds=2)).connect(address)
        client.handshake(consumer.layout, "decode-0")
        pull("req-a", [5, 6, 7, 8, 9])
        pull("req-b", list(range(40, 60)))
        assert [sink.one_sided for sink in sinks] == [False, True]
    try:
        with pytest.raises(KVTransferError):
            pull("req-c", [1, 2])
        assert not sinks[-1].one_sided
    finally:
        client.close()


@pytest.mark.parametrize("kernels_pidfd", [True, False], ids=["SO_PEERPIDFD", "pidfd_open"])
def test_the_producer_watched_is_the_one_proven_not_what_has_its_pid_by_then(monkeypatch, kernels_pidfd):
    """The consumer watches the process a direct pull's notice named: its one-sided reads go to
    that pid while the watch says it lives. The producer exits right after its notice, and a
    newcomer starts with its pid before the consumer's thread opens its watch (held back here): a
    pidfd opened from the pid was then the newcomer's ("alive"), and later one-sided reads would
    have read the newcomer's memory as KV. The watch is now the process proven on the consumer's
    peer connection (the kernel's pidfd of it, or, before Linux 6.5, one opened while it still
    held its end: an option number no kernel knows stands in for that here): exited."""
    skip_unless_pids_can_be_reused()
    if not kernels_pidfd:
        monkeypatch.setattr(peers, "SO_PEERPIDFD", 9999)
    consumer = make_cache(fill="zeros")
    scatterer = BlockScatterer(consumer, CHUNK)
    noticed: list[int] = []
    with running_producer() as (address, _):
        client = create_transport("shm", settings()).connect(address)
        monkeypatch.setattr(client, "_watch_peer_process", noticed.append)  # its thread, held back
        client.handshake(consumer.layout, "decode-0")
        scatterer.begin([5, 6, 7, 8, 9])
        client.pull("req-a", REQUESTS["req-a"], CacheSink(scatterer), engine_id="decode-0", timeout_s=20)
        assert_copied(consumer, "req-a", [5, 6, 7, 8, 9])
    newcomer = None
    try:
        [pid] = noticed
        newcomer = start_with_pid(pid)
        type(client)._watch_peer_process(client, pid)  # the watch opened only now
        assert not client._peer_alive(pid), f"pid {pid}'s newcomer watched as the producer"
    finally:
        if newcomer is not None:
            newcomer.kill()
            newcomer.wait(timeout=30)
        client.close()


PUSH_DELAY_S = 2.0


@pytest.fixture(scope="module")
def slow_pusher():
    """A producer whose direct pushes stall mid-pull (after its notice, before its write)."""
    with running_producer(fault_injection={"push_delay_s": PUSH_DELAY_S}) as producer:
        yield producer


@pytest.mark.parametrize("failure", ["consumer error", "deadline"])
def test_a_direct_pull_failing_mid_push_is_reported_only_after_the_push_ended(slow_pusher, failure):
    """vLLM hands a failed pull's blocks to another request: the consumer must not report the
    failure while the producer may still write into them. Whether the consumer's own half fails
    or its deadline passes, pull() raises only after the producer's write window closed."""
    address, conn = slow_pusher
    consumer = make_cache(fill="zeros")
    client = create_transport("shm", settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([0, 1])

        def fail(chunk):
            raise KVTransferError("the consumer's half failed")

        sink = CacheSink(scatterer, fail if failure == "consumer error" else None)
        timeout_s = 20 if failure == "consumer error" else 0.3
        reason = "half failed" if failure == "consumer error" else r"deadline: the producer's notice .* push ended"
        with pytest.raises(KVTransferError, match=reason):
            client.pull("req-c", REQUESTS["req-c"], sink, engine_id="decode-0", timeout_s=timeout_s)
        raised_at = time.monotonic()
    finally:
        client.close()
    conn.send("pushes")
    running, window_closed = conn.recv()
    assert running == 0 and 0 < window_closed <= raised_at


def test_a_consumer_stopped_mid_pull_does_not_hold_the_lease_for_good(slow_pusher):
    """A direct pull's producer holds the lease until the consumer says it has read its half: a
    consumer process stopped mid-pull (SIGSTOP: its call stays open, it says nothing, it cannot
    half-close at its deadline) held the lease's blocks, and a server thread, for as long as it
    stayed stopped. The producer now waits for its word only past the deadline the consumer sent;
    the consumer, resumed, accepts none of its reads that ended after that deadline."""
    address, conn = slow_pusher
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    consumer = ctx.Process(target=consumer_main, args=(child, address, "req-b", list(range(40, 60)), 4.0))
    consumer.start()
    try:

        def pushing() -> bool:
            conn.send("pushes")
            return conn.recv()[0] == 1

        wait_for(pushing, 60, "the producer to begin its push")  # it stalls PUSH_DELAY_S in it
        os.kill(consumer.pid, signal.SIGSTOP)

        def lease_free() -> bool:
            conn.send("pulling")
            return conn.recv()["req-b"] == 0

        wait_for(lease_free, 30, "the producer to stop holding the lease for the stopped consumer")
        os.kill(consumer.pid, signal.SIGCONT)
        assert parent.poll(60), "the resumed consumer did not finish its pull"
        outcome, detail = parent.recv()
        assert outcome == "failed" and "deadline" in detail, (outcome, detail)
    finally:
        os.kill(consumer.pid, signal.SIGCONT)
        consumer.join(30)
        if consumer.is_alive():
            consumer.kill()
