"""What crosses the KV wire, and whom a producer writes into, over real processes and sockets.

A spawned producer serves every backend (tests/unit/test_fast_transports.py's producer); this
process is the consumer. Every call a client makes is recorded (metadata and request bytes, as
the producer's server receives them): no secret and no derived key is among them. Direct shm
pushes go only into the process that proved itself on the producer's peer socket, inside the
regions it registered; a collective pair's rendezvous is reachable only from the session that
opened it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from pdcluster.keys import ENGINE_HTTP, KV_AUTH, KV_PARAMS, derive_key
from pdcluster.kv_transfer.auth import AUTH_METADATA_KEY
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport, peers, rpc
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.kv_transfer.transports.rpc import SERVICE
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.support.pids import skip_unless_pids_can_be_reused, start_with_pid
from tests.unit.kv_fixtures import make_cache
from tests.unit.kv_producer import CHUNK, REQUESTS, SECRET, assert_copied, pull, running_producer, settings


@pytest.fixture(scope="module")
def producer_process():
    with running_producer() as (address, _):
        yield address


class Recorder(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Every call's method, metadata and serialized request messages."""

    def __init__(self):
        self.calls: list[tuple[str, list, list[bytes]]] = []

    def _record(self, details, requests):
        self.calls.append((details.method.rsplit("/", 1)[1], list(details.metadata or ()), requests))

    def intercept_unary_unary(self, continuation, details, request):
        self._record(details, [request.SerializeToString()])
        return continuation(details, request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_stream(self, continuation, details, request_iterator):
        sent: list[bytes] = []
        self._record(details, sent)

        def recorded():
            for message in request_iterator:
                sent.append(message.SerializeToString())
                yield message

        return continuation(details, recorded())


@pytest.mark.parametrize(("backend", "direct"), [("grpc", False), ("shm", True), ("shm", False), ("collective", False)])
def test_no_secret_or_key_in_any_byte_the_producer_receives(producer_process, monkeypatch, backend, direct):
    recorder = Recorder()
    real = rpc.open_channel
    monkeypatch.setattr(rpc, "open_channel", lambda *a: grpc.intercept_channel(real(*a), recorder))
    dst = [40, 41, 42, 43, 44]
    assert_copied(pull(backend, producer_process, "req-a", dst, direct=direct)[0], "req-a", dst)
    methods = {method for method, _, _ in recorder.calls}
    assert {"Challenge", "Authenticate", "Handshake", "Release"} <= methods
    assert {"grpc": "Pull", "shm": "ShmPull", "collective": "CollectivePull"}[backend] in methods
    if direct:
        assert "ShmRegister" in methods
    keys = [derive_key(SECRET, purpose) for purpose in (KV_AUTH, KV_PARAMS, ENGINE_HTTP)]
    forbidden = [SECRET.encode(), *keys, *(k.hex().encode() for k in keys)]
    for method, metadata, requests in recorder.calls:
        wire = b"".join(requests) + b"".join(f"{k}={v}".encode() for k, v in metadata)
        for secret in forbidden:
            assert secret not in wire, (method, secret)


def authenticated(address):
    """A real client with a session and a handshake (a member of the cluster)."""
    client = create_transport("shm", settings()).connect(address)
    client.handshake(make_cache().layout, "decode-0")
    return client


def raw_shm_pull(client, first: pb.ShmPullRequest) -> tuple[grpc.StatusCode, str]:
    call = client._shm_pull(iter([first]), metadata=client.control.metadata("ShmPull"), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value.code(), info.value.details()


def register(client, regions, pid=None):
    proof, token = peers.prove(client.shm_socket, 5)
    request = pb.ShmRegisterRequest(
        token=token,
        pid=pid or os.getpid(),
        regions=[pb.Region(address=a, nbytes=n, row_bytes=r) for a, n, r in regions],
    )
    reply = client._shm_register(request, metadata=client.control.metadata("ShmRegister"), timeout=5)
    return proof, reply.registration


def our_regions(cache):
    sink = CacheSink(BlockScatterer(cache, CHUNK))
    return sink.host_regions()


def direct_pull(client, registration, pid, dst_ids, request_id="req-c"):
    return pb.ShmPullRequest(
        pull=client.pull_request(request_id, REQUESTS[request_id], "decode-0"),
        direct=True,
        pid=pid,
        registration=registration,
        block_ids=dst_ids,
    )


def test_a_direct_pull_naming_another_pid_or_no_registration_is_refused(producer_process):
    cache = make_cache(fill="zeros")
    client = authenticated(producer_process)
    try:
        proof, registration = register(client, our_regions(cache))
        foreign = raw_shm_pull(client, direct_pull(client, registration, os.getppid(), [0, 1]))
        unregistered = raw_shm_pull(client, direct_pull(client, "0" * 32, os.getpid(), [0, 1]))
        proof.close()
    finally:
        client.close()
    assert foreign[0] == grpc.StatusCode.PERMISSION_DENIED and "its registration pid" in foreign[1]
    assert unregistered[0] == grpc.StatusCode.PERMISSION_DENIED and "unknown shm registration" in unregistered[1]
    assert not cache.tensors[-1].any()  # nothing was written into our cache


def test_a_direct_pull_outside_the_registered_regions_is_refused(producer_process):
    cache = make_cache(fill="zeros")
    client = authenticated(producer_process)
    try:
        small = [(address, 2 * row, row) for address, _, row in our_regions(cache)]  # two blocks each
        proof, registration = register(client, small)
        outside = raw_shm_pull(client, direct_pull(client, registration, os.getpid(), [1, 2]))
        proof.close()
    finally:
        client.close()
    assert outside[0] == grpc.StatusCode.PERMISSION_DENIED and "outside registered region" in outside[1]
    assert not cache.tensors[-1].any()


def test_a_registration_needs_the_token_of_the_process_it_names(producer_process):
    client = authenticated(producer_process)
    try:
        with pytest.raises(grpc.RpcError) as info:
            register(client, our_regions(make_cache(fill="zeros")), pid=os.getppid())
    finally:
        client.close()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_registration_ends_with_the_connection_that_proved_it(producer_process):
    client = authenticated(producer_process)
    try:
        proof, registration = register(client, our_regions(make_cache(fill="zeros")))
        proof.close()  # what the consumer's exit does
        # The producer's peer thread notices the closed connection on its own: poll the refusal.
        deadline = time.monotonic() + 30
        while True:
            code, details = raw_shm_pull(client, direct_pull(client, registration, os.getpid(), [0, 1]))
            if "unknown shm registration" in details or time.monotonic() > deadline:
                break
            time.sleep(0.01)  # poll interval
        assert code == grpc.StatusCode.PERMISSION_DENIED and "unknown shm registration" in details
    finally:
        client.close()


def test_a_collective_pair_is_reachable_only_from_the_session_that_opened_it(producer_process):
    """Another cluster member (its own session) holding the pair's group key can neither read
    nor write the pair's rendezvous store nor pull on its group; without a session, nothing."""
    owner = create_transport("collective", settings()).connect(producer_process)
    other = create_transport("collective", settings()).connect(producer_process)
    try:
        owner.handshake(make_cache().layout, "decode-0")
        other.handshake(make_cache().layout, "decode-1")
        owner._ensure_group("decode-0")
        key = owner._key
        for op in ("get", "set"):
            with pytest.raises(grpc.RpcError) as info:
                other.store_call(pb.CollectiveStoreRequest(group_key=key, op=op, key="0/1", value=b"x"), timeout=5)
            assert info.value.code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.RpcError) as info:
            request = pb.CollectivePullRequest(pull=other.pull_request("req-c", [1, 2], "decode-1"), group_key=key)
            list(other._collective_pull(request, metadata=other.control.metadata("CollectivePull"), timeout=5))
        assert info.value.code() == grpc.StatusCode.ABORTED
        with grpc.insecure_channel(producer_process) as channel:
            store = channel.unary_unary(f"/{SERVICE}/CollectiveStore")
            request = pb.CollectiveStoreRequest(group_key=key, op="get", key="0/0").SerializeToString()
            with pytest.raises(grpc.RpcError) as info:
                store(request, metadata=((AUTH_METADATA_KEY, "forged.1.00"),), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The pair still works for its owner.
        consumer = make_cache(fill="zeros")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([5, 6])
        owner.pull("req-c", REQUESTS["req-c"], scatterer.write, engine_id="decode-0", timeout_s=20)
        assert_copied(consumer, "req-c", [5, 6])
    finally:
        owner.close()
        other.close()


def test_foreign_bytes_on_the_pairs_sockets_neither_join_nor_break_a_pair(producer_process):
    """The producer listens on its gRPC port and its gloo pairs' sockets, nothing else (no store
    port), all on the KV host; random bytes a foreigner sends to every one of them change nothing:
    the pair's next pull is exact, and so is a new pair's."""
    port = int(producer_process.rsplit(":", 1)[1])
    (producer,) = [
        child
        for child in psutil.Process().children()
        if any(c.laddr.port == port for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
    ]
    owner = create_transport("collective", settings()).connect(producer_process)
    try:
        owner.handshake(make_cache().layout, "decode-0")
        consumer = make_cache(fill="zeros")
        scatterer = BlockScatterer(consumer, CHUNK)
        for dst in ([7, 8], [9, 10]):
            scatterer.begin(dst)
            owner.pull("req-c", REQUESTS["req-c"], scatterer.write, engine_id="decode-0", timeout_s=20)
            assert_copied(consumer, "req-c", dst)
            listening = [c.laddr for c in producer.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            assert {address.ip for address in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}
            for address in listening:
                if address.port != port:
                    with socket.create_connection(("127.0.0.1", address.port), timeout=5) as intruder:
                        intruder.sendall(os.urandom(4096))
    finally:
        owner.close()
    dst = [11, 12, 13, 14, 15]
    assert_copied(pull("collective", producer_process, "req-a", dst, direct=False)[0], "req-a", dst)


def test_a_new_session_unmaps_the_segments_of_the_producer_that_forgot_us(producer_process):
    """After a producer restart (a new session), its old segments are only memory we keep alive:
    the client unmaps them."""
    client = create_transport("shm", settings()).connect(producer_process)
    try:
        consumer = make_cache(fill="zeros")
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin([3, 4])
        client.pull("req-c", REQUESTS["req-c"], scatterer.write, engine_id="decode-0", timeout_s=20)
        assert client._segments  # the ring's segment, mapped
        with client.control._lock:
            client.control._session = None  # what StaleSessionError does (rpc.ControlChannel.call)
        client.control.session()
        assert client._segments == {}
    finally:
        client.close()


def test_the_peer_registry_works_with_descriptors_past_1024():
    """A producer process with many descriptors open (an unauthenticated peer can hold idle
    connections to its KV port; Ray raises the limit): select() refused descriptors past 1024,
    which ended the peer socket's thread for good and made every direct pull's liveness check
    raise. The registry proves, registers, looks up and notices an exit at any descriptor."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine's open-file limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    registry = peers.PeerRegistry("fds")
    consumer = (  # proves itself, then holds its connection until its stdin closes
        "import sys; from pdcluster.kv_transfer.transports import peers\n"
        "sock, token = peers.prove(sys.argv[1], 10); print(token, flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", consumer, registry.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        token = child.stdout.readline().strip()
        rid = registry.register(token, child.pid, "session", [(4096, 4096, 1024)])
        assert registry.lookup(rid, "session", child.pid).pidfd > 1024
        child.stdin.close()  # the consumer exits: its connection closes
        assert peers.wait_exit(child.pid, 30)
        deadline = time.monotonic() + 10
        while True:  # the socket's thread notices, and the registration ends
            with pytest.raises(peers.PeerRefused, match="exited|unknown") as refused:
                registry.lookup(rid, "session", child.pid)
            if "unknown" in str(refused.value):
                break
            assert time.monotonic() < deadline, "the closed connection was not noticed"
            time.sleep(0.01)  # poll interval
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        registry.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_registry_closed_at_once_ends_its_thread_without_an_error(monkeypatch):
    """A producer that closes its peer registry right after making it (its server failed to
    start, or the engine stopped at once): the socket's thread registered the listener only once
    it ran, by then closed, and died with 'Invalid file descriptor: -1'."""
    import threading

    died = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    for index in range(20):
        registry = peers.PeerRegistry(f"closed-{index}")
        thread = registry._thread
        registry.close()
        thread.join(10)
        assert not thread.is_alive()
    assert died == []


PROVER = (  # a consumer that proves itself, says who it is and what it was given, and exits
    "import os, sys\n"
    "from pdcluster.kv_transfer.transports.peers import prove\n"
    "sock, token = prove(sys.argv[1], 30)\n"
    "print(os.getpid(), token, flush=True)\n"
)


@pytest.mark.parametrize("kernels_pidfd", [True, False], ids=["SO_PEERPIDFD", "pidfd_open"])
def test_a_proven_consumer_whose_pid_is_reused_before_it_registers_is_refused(monkeypatch, kernels_pidfd):
    """A consumer proves itself (the token) and exits before its registration is handled, and a
    process of the same user starts with its pid: the registration is refused, not bound to the
    newcomer (whose memory the producer's direct pushes would then write). The registry's thread
    has not yet seen the connection close (held back here): the pid was looked up again at
    registration, and found the newcomer. Also where the kernel offers no pidfd of a socket's peer
    (before Linux 6.5; an option number no kernel knows stands in for it here)."""
    skip_unless_pids_can_be_reused()
    if not kernels_pidfd:
        monkeypatch.setattr(peers, "SO_PEERPIDFD", 9999)
    registry = peers.PeerRegistry("reuse")
    held = []
    monkeypatch.setattr(registry, "_forget", held.append)  # the thread has not got to it yet
    newcomer = None
    try:
        prover = subprocess.run(
            [sys.executable, "-c", PROVER, registry.name], capture_output=True, text=True, timeout=120
        )
        assert prover.returncode == 0, prover.stderr[-2000:]
        pid, token = prover.stdout.split()
        newcomer = start_with_pid(int(pid))
        with pytest.raises(peers.PeerRefused, match=f"pid {pid}"):
            registry.register(token, int(pid), "session-1", [(0x10000, 4096, 1024)])
    finally:
        if newcomer is not None:
            newcomer.kill()
            newcomer.wait(timeout=30)
        registry.close()
        for conn in held:
            conn.close()


def test_an_ended_registration_is_not_alive_whatever_its_old_pidfd_number_holds_now():
    """A push thread holds a registration (lookup) and asks alive() as it writes; the consumer
    exits and the registry's thread ends the registration, closing its pidfd. The number is
    free then, and the next descriptor opened gets it: alive() polled that one, a live process's
    pidfd here, and said the consumer was alive."""
    registry = peers.PeerRegistry("ended")
    prover = subprocess.Popen(
        [sys.executable, "-c", PROVER + "sys.stdin.read()\n", registry.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    opened = []
    try:
        pid, token = prover.stdout.readline().split()
        registration_id = registry.register(token, int(pid), "session-1", [(0x10000, 4096, 1024)])
        registration = registry.lookup(registration_id, "session-1", int(pid))  # as a push holds it
        number = registration.pidfd
        prover.stdin.close()  # the consumer exits
        assert prover.wait(timeout=60) == 0
        deadline = time.monotonic() + 60
        while registration_id in registry._registrations:  # the registry's thread ends it
            assert time.monotonic() < deadline, "the registration outlived its consumer's connection"
            time.sleep(0.01)  # poll interval
        while len(opened) < 256 and number not in opened:  # the next descriptors: a live process's
            opened.append(os.pidfd_open(os.getpid()))
        assert number in opened, f"descriptor {number} was not opened again"
        assert not registration.alive()
    finally:
        for fd in opened:
            os.close(fd)
        if prover.poll() is None:
            prover.kill()
            prover.wait(timeout=30)
        prover.stdout.close()
        registry.close()
