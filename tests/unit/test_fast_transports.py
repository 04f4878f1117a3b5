"""The shm and collective transports between two real processes on 127.0.0.1 (mooncake:
test_mooncake.py).

A spawned producer process serves a cache with leased requests over one control server that
offers every backend; this process pulls through the real clients into its own cache. shm moves
bytes through /dev/shm (ring) or cross-process copies (direct: its fences and early reads in
test_direct_shm.py); collective through a real gloo pair group built on first use.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdcluster.errors import AuthenticationError, LeaseNotFoundError
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.kv_transfer.transports.segments import SHM_DIR, owner_prefix
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.support.cma import cross_process_copies_refused
from tests.support.engines import REPO
from tests.unit.kv_fixtures import make_cache
from tests.unit.kv_producer import CHUNK, REQUESTS, assert_copied, pull, running_producer, settings


@pytest.mark.parametrize(("backend", "direct"), [("shm", True), ("shm", False), ("collective", False)])
@pytest.mark.parametrize("request_id", ["req-a", "req-b"])
def test_pull_copies_blocks_exactly(producer_process, backend, direct, request_id):
    address, _ = producer_process
    dst_ids = [50 - i for i in range(len(REQUESTS[request_id]))]
    consumer, nbytes = pull(backend, address, request_id, dst_ids, direct=direct)
    assert nbytes == len(dst_ids) * consumer.layout.bytes_per_block()
    assert_copied(consumer, request_id, dst_ids)


@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_a_pull_after_the_producer_forgot_our_session_goes_as_before(producer_process, backend):
    """The producer forgets every session (as when it restarts, or evicts ours): the next pull is
    refused as stale and goes again on a new session. It once went again with the old session's
    state: shm sent its old registration (refused: direct reads given up for good), collective
    its old pair group (refused: a failed pull)."""
    address, control = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport(backend, settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        for request_id, dst_ids in (("req-a", [40, 41, 42, 43, 44]), ("req-c", [7, 8])):
            scatterer.begin(dst_ids)
            client.pull(request_id, REQUESTS[request_id], CacheSink(scatterer), engine_id="decode-0", timeout_s=20)
            assert_copied(consumer, request_id, dst_ids)
            control.send("forget")
            assert control.recv() == "forgot"
        # still direct: the registration went anew (where copies between processes are allowed)
        assert backend != "shm" or client.direct == (cross_process_copies_refused() is None)
    finally:
        client.close()


def test_shm_segments_are_private_to_this_user(producer_process):
    address, conn = producer_process
    pull("shm", address, "req-c", [5, 6], direct=False)
    conn.send("segments")
    names = conn.recv()
    assert names  # the ring of the pull above, kept for reuse until the server stops
    for name in names:
        mode = stat.S_IMODE((SHM_DIR / name).stat().st_mode)
        assert mode == 0o600, f"{name} has mode {mode:o}"


def test_collective_pulls_from_threads_are_serialized_per_pair(producer_process):
    """Concurrent pulls share one pair group; each gets its own bytes."""
    from concurrent.futures import ThreadPoolExecutor

    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport("collective", settings()).connect(address)
    client.handshake(consumer.layout, "decode-1")
    plans = {"req-a": [40, 41, 42, 43, 44], "req-b": list(range(0, 20)), "req-c": [60, 61]}

    def one(request_id):
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin(plans[request_id])
        return client.pull(request_id, REQUESTS[request_id], scatterer.write, engine_id="decode-1", timeout_s=20)

    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(one, list(plans) * 2))
    finally:
        client.close()
    for request_id, dst_ids in plans.items():
        assert_copied(consumer, request_id, dst_ids)


def test_collective_pulls_of_different_consumers_at_once_each_get_their_own_bytes(producer_process):
    """Two consumers (two pairs) pull different requests from one producer at the same time, many
    chunks each: each pull's chunks travel through buffers of its own (a producer that gathered
    every pair's chunks into one pair of buffers sent one request's KV to the other consumer)."""
    from concurrent.futures import ThreadPoolExecutor

    address, _ = producer_process
    plans = {"req-a": [40, 41, 42, 43, 44], "req-b": list(range(0, 20))}
    clients = {}
    for request_id in plans:
        clients[request_id] = create_transport("collective", settings()).connect(address)
        clients[request_id].handshake(make_cache().layout, f"decode-{request_id}")

    def rounds(request_id):
        consumer = make_cache(fill="zeros")
        scatterer = BlockScatterer(consumer, CHUNK)
        for _ in range(12):
            consumer.tensors[0].zero_()
            scatterer.begin(plans[request_id])
            clients[request_id].pull(
                request_id, REQUESTS[request_id], scatterer.write, engine_id=f"decode-{request_id}", timeout_s=20
            )
            assert_copied(consumer, request_id, plans[request_id])

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rounds, plans))
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("backend", ["shm", "collective"])
def test_unknown_request_is_not_found(producer_process, backend):
    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = create_transport(backend, settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([1])
        with pytest.raises(LeaseNotFoundError):
            client.pull("nope", [1], CacheSink(scatterer), engine_id="decode-0", timeout_s=20)
    finally:
        client.close()


@pytest.mark.parametrize("method", ["ShmPull", "CollectiveOpen"])
def test_wrong_secret_learns_no_segment_or_group(producer_process, method):
    from pdcluster.kv_transfer.transports.grpc_transport import SERVICE

    address, _ = producer_process
    with grpc.insecure_channel(address) as channel:
        if method == "ShmPull":
            call = channel.stream_stream(
                f"/{SERVICE}/ShmPull",
                request_serializer=pb.ShmPullRequest.SerializeToString,
                response_deserializer=pb.ShmChunk.FromString,
            )
            request = pb.ShmPullRequest(pull=pb.PullRequest(request_id="req-a", block_ids=[3]))
            with pytest.raises(grpc.RpcError) as info:
                list(call(iter([request]), metadata=(("x-pdcluster-kv-secret", "wrong"),), timeout=10))
        else:
            call = channel.unary_unary(
                f"/{SERVICE}/CollectiveOpen",
                request_serializer=pb.CollectiveOpenRequest.SerializeToString,
                response_deserializer=pb.CollectiveOpenResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as info:
                call(pb.CollectiveOpenRequest(backend="gloo", device_kind="cpu"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_wrong_secret_client_is_refused(producer_process):
    address, _ = producer_process
    client = create_transport("shm", KVTransferSettings(secret="wrong")).connect(address)
    try:
        with pytest.raises(AuthenticationError):
            client.handshake(make_cache().layout, "intruder")
    finally:
        client.close()


def test_collective_backend_mismatch_names_both_sides(producer_process):
    """A consumer on another device kind is refused at open, naming both backends."""
    from pdcluster.errors import HandshakeError
    from pdcluster.kv_transfer.transports.collective import CollectiveClient

    address, _ = producer_process
    consumer = make_cache(fill="zeros")
    client = CollectiveClient(address, settings())
    client.backend = "nccl"  # what a CUDA consumer would ask for
    try:
        client.handshake(consumer.layout, "decode-gpu")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([1])
        with pytest.raises(HandshakeError, match="producer\\) uses gloo on cpu, decode \\(consumer\\) nccl"):
            client.pull("req-c", REQUESTS["req-c"], scatterer.write, engine_id="decode-gpu", timeout_s=20)
    finally:
        client.close()


def test_segment_files_are_unlinked_on_stop(tmp_path):
    cache = make_cache()
    producer = KVProducer(cache, "prefill-x", max_chunk_bytes=CHUNK)
    producer.leases.add("r", [1, 2, 3], time.monotonic() + 60)
    server = create_transport("shm", settings()).serve(producer, "127.0.0.1", 0)
    try:
        consumer, _ = pull_local(server.address)
    finally:
        server.stop(0)
    assert not list(Path(SHM_DIR).glob(f"{owner_prefix(os.getpid())}*"))


def pull_local(address):
    consumer = make_cache(fill="zeros")
    client = create_transport("shm", settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([7, 8, 9])
        return consumer, client.pull("r", [1, 2, 3], scatterer.write, engine_id="decode-0", timeout_s=20)
    finally:
        client.close()


def test_handshake_tells_where_the_producer_runs_and_what_it_offers(producer_process):
    """What is static per producer (node, cache device, backends) comes once per connection in
    the handshake, from the producer's own server, not in every request's kv_transfer_params."""
    from pdcluster.kv_transfer.transports.selection import node_id

    address, _ = producer_process
    client = create_transport("grpc", settings()).connect(address)
    try:
        info = client.handshake(make_cache(fill="zeros").layout, "decode-0")
    finally:
        client.close()
    assert info.engine_id == "prefill-0"
    assert info.offers == ("grpc", "shm", "collective")
    assert (info.node_id, info.device_kind) == (node_id(), "cpu")  # another process, this host


SMALL_SHM = """
import sys
from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.transports.segments import Segment, SEGMENT_PREFIX
from pdcluster.kv_transfer.transports.shm_server import check_ring_budget
try:
    Segment(SEGMENT_PREFIX + "1-" + "0" * 16, 8 << 20, create=True)
except KVTransferError as exc:
    print("segment:", exc)
try:
    check_ring_budget(8 << 20, 1)
except KVTransferError as exc:
    print("budget:", exc)
"""


def test_a_full_dev_shm_is_a_clear_error_when_a_ring_is_made_not_a_sigbus_later():
    """In a mount namespace of its own, /dev/shm is a 1 MiB tmpfs: an 8 MiB segment is refused
    when it is made (its pages are allocated then), and the producer's start-up budget check
    names the shortfall."""
    from tests.support.hosts import CAP_SYS_ADMIN, has_capabilities

    if os.geteuid() != 0 or not shutil.which("unshare") or not has_capabilities(CAP_SYS_ADMIN):
        pytest.skip("needs root with CAP_SYS_ADMIN and unshare(1) for a private /dev/shm")
    script = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && {sys.executable} -c '{SMALL_SHM}'"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("segment: cannot allocate 8388608 bytes of shared memory in /dev/shm") for line in lines
    ), lines
    assert any(line.startswith("budget: /dev/shm has") and "one shm ring needs 8388608" in line for line in lines), (
        lines
    )


RING_MAKER = """
import sys, time
from pdcluster.kv_transfer.transports.segments import Ring
print(Ring(4096).segment.name, flush=True)
time.sleep(600)
"""


def test_a_killed_producers_segments_are_removed_by_the_next_producer():
    """A producer killed (SIGKILL, the OOM killer) cannot unlink its rings: their tmpfs pages
    stayed in /dev/shm for good, and enough of them made the next producer's ring budget fail.
    The next producer started in the same pid namespace removes them; a segment named by
    another pid namespace (test hosts share /dev/shm) is left alone."""
    import secrets as random_names
    import signal

    from pdcluster.kv_transfer.transports.shm_server import ShmExtension
    from pdcluster.pidfds import pid_namespace

    if not pid_namespace():
        pytest.skip("/proc does not say which pid namespace this is")
    maker = subprocess.Popen([sys.executable, "-c", RING_MAKER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    name = maker.stdout.readline().strip()
    os.kill(maker.pid, signal.SIGKILL)
    maker.wait(30)
    left = SHM_DIR / name
    other = SHM_DIR / f"pdcluster-kv-0123456789ab42.{maker.pid}-{random_names.token_hex(8)}"
    other.touch(mode=0o600)
    try:
        assert left.exists()  # nobody unlinked it
        extension = ShmExtension(KVProducer(make_cache(), "prefill-0", max_chunk_bytes=CHUNK, lease_wait_s=0.5))
        extension.close()
        assert not left.exists() and other.exists()
    finally:
        left.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_consumers_that_open_a_pair_and_never_join_do_not_hold_up_another():
    """Two consumers open a collective pair and never join its rendezvous (failed locally, died,
    or reopened). Each pair's build waits up to the producer's pull timeout: on a pool of two
    builders a third consumer's build waited behind both, past its own rendezvous deadline, and
    its pull failed. Builds no longer queue behind each other."""
    with running_producer(pull_timeout_seconds=4) as (address, _):
        absent = [create_transport("collective", settings()).connect(address) for _ in range(2)]
        try:
            for client in absent:
                opened = client._open(
                    pb.CollectiveOpenRequest(consumer_engine_id="decode-absent", backend="gloo", device_kind="cpu"),
                    metadata=client.control.metadata("CollectiveOpen"),
                    timeout=5,
                )
                assert opened.group_key and not opened.error
            consumer = make_cache(fill="zeros")
            client = create_transport("collective", settings(pull_timeout_seconds=2)).connect(address)
            try:
                client.handshake(consumer.layout, "decode-0")
                scatterer = BlockScatterer(consumer, CHUNK)
                scatterer.begin([40, 41, 42, 43, 44])
                client.pull("req-a", REQUESTS["req-a"], CacheSink(scatterer), engine_id="decode-0", timeout_s=2)
                assert_copied(consumer, "req-a", [40, 41, 42, 43, 44])
            finally:
                client.close()
        finally:
            for client in absent:
                client.close()
