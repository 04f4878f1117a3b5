"""A producer in another process for the transport tests: a seeded cache with leased requests,
served over one control server that offers every backend."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator

import torch

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.faults import FaultInjector
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport, serve_backends
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.kv_transfer.transports.collective import CollectiveExtension
from pdcluster.kv_transfer.transports.segments import SHM_DIR, owner_prefix
from pdcluster.kv_transfer.transports.shm_server import ShmExtension
from tests.unit.kv_fixtures import make_cache

SECRET = "fast-transport-secret"
CHUNK = 4096  # small chunks: many per pull, so the ring wraps and sends pipeline
STAGING_CHUNK = 3 * CHUNK  # mooncake's staged chunks: a few per pull, each landed in CHUNK pieces
REQUESTS = {"req-a": [3, 9, 10, 11, 60], "req-b": list(range(20, 40)), "req-c": [1, 2]}


def settings(**overrides) -> KVTransferSettings:
    overrides.setdefault("pull_timeout_seconds", 20)
    return KVTransferSettings(
        secret=SECRET,
        max_chunk_bytes=CHUNK,
        # Blocks here are 1 KiB a layer, every run short of TCP's in-place floor: mooncake reads in
        # place unless a test asks for the floor (test_mooncake's short-run test).
        mooncake={"staging_chunk_bytes": STAGING_CHUNK, "in_place_min_run_bytes": 0, **overrides.pop("mooncake", {})},
        **overrides,
    )


PLAIN = ("grpc", "shm", "collective")  # what a producer bound to loopback offers on auto


def _without_done(pull):
    """A collective producer that breaks the protocol: every message of a pull but its last."""

    def pull_without_done(self, request, session, context):
        for message in pull(self, request, session, context):
            if not message.done:
                yield message

    return pull_without_done


def producer_main(
    conn,
    overrides: dict,
    backends: tuple[str, ...] = PLAIN,
    port: int = 0,
    strided: bool = False,
    collective_without_done: bool = False,
) -> None:
    if collective_without_done:
        CollectiveExtension._pull = _without_done(CollectiveExtension._pull)
    cache = make_cache(seed=7, strided=strided)
    served = settings(**overrides)
    producer = KVProducer(
        cache, "prefill-0", max_chunk_bytes=CHUNK, lease_wait_s=0.5, faults=FaultInjector(served.fault_injection)
    )
    for request_id, ids in REQUESTS.items():
        producer.leases.add(request_id, ids, time.monotonic() + 600)
    server = serve_backends(list(backends), served, producer, "127.0.0.1", port)
    shm = next((e for e in server._extensions if isinstance(e, ShmExtension)), None)
    conn.send(server.address)
    while (command := conn.recv()) != "stop":
        if command == "segments":
            conn.send(sorted(p.name for p in SHM_DIR.glob(f"{owner_prefix(os.getpid())}*")))
        elif command == "released":
            conn.send(sorted(lease.request_id for lease in producer.leases.collect_finished()))
        elif command == "pushes":  # (direct pushes running, monotonic end of the last one)
            conn.send((shm.pushing, shm.last_push_end))
        elif command == "pulling":  # the pulls in progress, by request
            conn.send({lease.request_id: lease.active_pulls for lease in list(producer.leases._leases.values())})
        elif command == "forget":  # every consumer's session, as a restart (or eviction) does
            with server.auth._lock:
                server.auth._sessions.clear()
            conn.send("forgot")
    server.stop(0)
    conn.send(owner_prefix(os.getpid()))  # while it runs: the names carry its start


@contextlib.contextmanager
def running_producer(
    backends: tuple[str, ...] = PLAIN,
    port: int = 0,
    strided: bool = False,
    collective_without_done: bool = False,
    **overrides,
) -> Iterator[tuple[str, object]]:
    """(the producer's address, a pipe to ask it "segments", "released", "pushes" or "pulling"); `overrides`:
    its KV settings (fault injection); `backends`: what its server offers; `port`: its port (0:
    any free one); `strided`: its cache's layers are not contiguous rows (make_cache);
    `collective_without_done`: its collective pulls end without their last message."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, overrides, backends, port, strided, collective_without_done)
    proc = ctx.Process(target=producer_main, args=args)
    proc.start()
    while not parent.poll(0.1):  # its address, once it serves; a producer that died says nothing
        assert proc.is_alive(), f"the producer process exited with {proc.exitcode} before serving"
    try:
        yield parent.recv(), parent
    finally:
        parent.send("stop")
        prefix = parent.recv()
        proc.join(30)
        # Every segment is unlinked when the server stops.
        assert not list(SHM_DIR.glob(f"{prefix}*"))


def assert_copied(consumer, request_id, dst_ids) -> None:
    source = make_cache(seed=7)
    for src, dst in zip(source.tensors, consumer.tensors):
        assert torch.equal(dst[dst_ids], src[REQUESTS[request_id]])


def pull(
    backend: str, address: str, request_id: str, dst_ids, *, direct: bool, strided: bool = False, timeout_s: float = 20
):
    """A consumer cache with REQUESTS[request_id] pulled into dst_ids, and the bytes received."""
    consumer = make_cache(fill="zeros", strided=strided)
    client = create_transport(backend, settings()).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, CHUNK)
        scatterer.begin(dst_ids)
        # A plain callable sink never offers the cache for direct copies: the shm ring is used.
        sink = CacheSink(scatterer) if direct else scatterer.write
        nbytes = client.pull(request_id, REQUESTS[request_id], sink, engine_id="decode-0", timeout_s=timeout_s)
        # A release of a lease not filed yet (kept for when it is: answered True): every control
        # call gets exercised.
        assert client.release(request_id + "-unfiled", transferred=False, engine_id="decode-0", timeout_s=5)
    finally:
        client.close()
    return consumer, nbytes


def consumer_main(conn, address: str, request_id: str, dst_ids: list[int], timeout_s: float) -> None:
    """A consumer in another process (one a test can stop): one direct pull of `request_id` into
    a zeroed cache; sends ("pulled", bytes) or ("failed", the error)."""
    try:
        _, nbytes = pull("shm", address, request_id, dst_ids, direct=True, timeout_s=timeout_s)
        conn.send(("pulled", nbytes))
    except KVTransferError as exc:
        conn.send(("failed", str(exc)))
