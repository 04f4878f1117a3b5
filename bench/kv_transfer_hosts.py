"""bench/kv_transfer.py --cross-host: the producer and the consumer on two test hosts.

The hosts are tests/support/hosts.py's (`make_hosts(2)`: network namespaces on a veth bridge at
198.18.0.11 and .12, each with its own hostname, IPC, /dev/shm and PID namespace). This process
starts each side inside its host as `bench/kv_transfer.py ... --role producer|consumer --host
ADDRESS`; each side's stdin is a socket to this process, which sends it the run's secret and then
relays the control messages (the producer's addresses, the CPU-time asks, the consumer's rows).
Both sides bind and advertise their host's address. The producer also runs a raw TCP sender, and
the consumer times it (same byte count, one plain socket, host 1 to host 2) next to each pull and
its memcpy: the ceiling the network path between the hosts allows. With a mooncake transport the
producer also registers a buffer with its transfer engine, and the consumer times Mooncake's own
best case (the same byte count read in 256 MiB single-descriptor reads into a registered buffer):
the ceiling any use of Mooncake's TCP transport can reach there. shm is not measured: it moves
bytes within one host only. Needs root. Results:
bench/results/<date>-kv-transfer-<transports joined by '-'>-cross-host.{json,md}.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_transfer import (  # noqa: E402
    ROUNDS,
    answer_rusage,
    pull_plan,
    run_pulls,
    serving,
    transport_settings,
    uses_mooncake,
)
from bench.kv_transfer_results import write_results  # noqa: E402
from pdcluster.kv_transfer.kv_cache import huge_pages  # noqa: E402
from pdcluster.kv_transfer.transports.mooncake_engine import engine_for  # noqa: E402
from tests.support.hosts import Host, make_hosts  # noqa: E402

SCRIPT = ROOT / "bench" / "kv_transfer.py"
SENDER_BUFFER = 256 << 20  # raw TCP: the sender cycles through this many random bytes
MOONCAKE_READ = 256 << 20  # raw Mooncake: one descriptor per read of at most this many bytes
READY_S = 300  # a side's caches are made and its servers listen within this
STEP_S = 1800  # the longest a side may stay silent between two control messages
METHOD = (
    f"{ROUNDS}; cache-to-cache pull from a producer on "
    "test host 1 to a consumer on test host 2: two network namespaces (own hostname, IPC, /dev/shm "
    "and PID namespace) joined by veth links on a bridge, the kernel's TCP stack between them; both "
    "caches on 2 MiB pages as the connector backs them; memcpy = ctypes.memmove of the same byte "
    "count between two buffers on 2 MiB pages on host 2, one thread, same run"
)


@contextlib.contextmanager
def tcp_sender(host: str, chunk_bytes: int):
    """Raw TCP, sending side: one connection; per 8-byte count it reads, that many bytes as
    chunk-sized slices of a fixed random buffer (no framing, no copy in Python). Yields host:port."""
    view = memoryview(torch.empty(SENDER_BUFFER, dtype=torch.uint8).random_().numpy())
    listener = socket.create_server((host, 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while header := conn.recv(8, socket.MSG_WAITALL):  # b"": the receiver is done
                total, sent = int.from_bytes(header, "big"), 0
                while sent < total:
                    n = min(chunk_bytes, total - sent)
                    offset = sent % (len(view) - n)
                    conn.sendall(view[offset : offset + n])
                    sent += n

    threading.Thread(target=serve, name="raw-tcp-sender", daemon=True).start()
    try:
        yield f"{host}:{listener.getsockname()[1]}"
    finally:
        listener.close()


@contextlib.contextmanager
def mooncake_source(args):
    """Raw Mooncake, producer side: MOONCAKE_READ random bytes registered with this side's
    transfer engine (the KV server's own). Yields (session, address), or None without mooncake."""
    if not uses_mooncake(args.transports):
        yield None
        return
    engine = engine_for("producer", args.host, transport_settings(args))
    buffer = torch.empty(MOONCAKE_READ, dtype=torch.uint8).random_()
    region = [(buffer.data_ptr(), MOONCAKE_READ)]
    engine.register(region, buffer)
    try:
        yield engine.session, buffer.data_ptr()
    finally:
        engine.unregister(region, buffer)


class MooncakeReader:
    """Raw Mooncake, consumer side: reads n bytes out of the producer's buffer into a registered
    destination of n bytes on 2 MiB pages, one descriptor per MOONCAKE_READ."""

    def __init__(self, args, source: tuple[str, int]):
        self.session, self.remote = source
        self.engine = engine_for("consumer", args.host, transport_settings(args))

    def time(self, nbytes: int, repeats: int) -> float:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        huge_pages([dst])
        region = [(dst.data_ptr(), nbytes)]
        self.engine.register(region, dst)
        reads = [(offset, min(MOONCAKE_READ, nbytes - offset)) for offset in range(0, nbytes, MOONCAKE_READ)]
        local = [dst.data_ptr() + offset for offset, _ in reads]
        times = []
        try:
            for _ in range(repeats + 1):  # the first warms the engine's connections
                t0 = time.perf_counter()
                for address, (_, n) in zip(local, reads):
                    self.engine.read(self.session, [address], [self.remote], [n], time.monotonic() + 600, 60)
                times.append(time.perf_counter() - t0)
        finally:
            self.engine.unregister(region, dst)
        return statistics.median(times[1:])


class TcpReceiver:
    """Raw TCP, receiving side: asks for n bytes and reads them into a destination of n bytes on
    2 MiB pages (where KV lands in a cache), over one connection kept for the whole run."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=600)

    def time(self, nbytes: int, repeats: int) -> float:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        huge_pages([dst])
        view = memoryview(dst.numpy())
        times = []
        for _ in range(repeats + 1):  # the first warms the connection's windows
            t0 = time.perf_counter()
            self.sock.sendall(nbytes.to_bytes(8, "big"))
            got = 0
            while got < nbytes:
                n = self.sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the raw TCP sender closed the connection mid-stream")
                got += n
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def close(self) -> None:
        self.sock.close()


def role_main(args) -> int:
    """One side, inside its host. stdin is the control socket: the secret first, then messages."""
    conn = Connection(sys.stdin.fileno())
    args.secret = conn.recv()
    num_blocks, requests = pull_plan(args)
    if args.role == "producer":
        with (
            serving(args, num_blocks, requests) as (address, raw_grpc),
            tcp_sender(args.host, args.chunk_bytes) as tcp,
            mooncake_source(args) as mooncake,
        ):
            conn.send((address, raw_grpc, tcp, mooncake))  # ready: every server listens
            answer_rusage(conn)
        return 0
    address, raw_grpc, tcp, mooncake = conn.recv()
    with contextlib.closing(TcpReceiver(tcp)) as receiver:
        ceilings = {"tcp": lambda nbytes: receiver.time(nbytes, args.repeats)}
        if mooncake is not None:
            reader = MooncakeReader(args, mooncake)
            ceilings["mooncake"] = lambda nbytes: reader.time(nbytes, args.repeats)
        rows = run_pulls(args, address, raw_grpc, num_blocks, requests, conn, ceilings)
    conn.send(rows)
    return 0


def receive(conn: Connection, what: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"cross-host bench: no {what} within {timeout_s:.0f} s")
    return conn.recv()  # EOFError: that side exited (its traceback is on stderr)


@contextlib.contextmanager
def side(host: Host, role: str, argv: list[str], secret: str):
    """Start one side inside `host`, its stdin a socket to us; hand it the secret; yield the
    connection. On exit: close it (a side still waiting sees EOF and ends) and reap the side."""
    ours, theirs = socket.socketpair()
    with theirs:
        command = [sys.executable, str(SCRIPT), *argv, "--role", role, "--host", host.address]
        proc = host.popen(command, stdin=theirs)
    conn = Connection(ours.detach())
    try:
        conn.send(secret)
        yield conn
    finally:
        conn.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()  # nsenter; make_hosts' exit then ends every process of the host
            proc.wait(30)
    if proc.returncode:
        raise RuntimeError(f"cross-host bench: the {role} on {host.name} exited with {proc.returncode}")


def bridge_bytes(host: Host) -> int:
    """Bytes the host has sent onto the bridge (what its veth's bridge side received)."""
    return int(Path(f"/sys/class/net/{host.veth}/statistics/rx_bytes").read_text())


def cross_host_main(args, argv: list[str]) -> int:
    if args.role:
        return role_main(args)
    if os.geteuid() != 0:
        raise SystemExit("--cross-host makes network namespaces (tests/support/hosts.py): run it as root")
    secret = secrets.token_urlsafe(32)  # this run's only; travels on the sides' stdin, not argv
    with make_hosts(2) as (host1, host2):
        with side(host1, "producer", argv, secret) as producer, side(host2, "consumer", argv, secret) as consumer:
            addresses = receive(producer, "producer readiness", READY_S)
            sent_before = bridge_bytes(host1)
            consumer.send(addresses)
            while (message := receive(consumer, "message from the consumer", STEP_S)) == "rusage":
                producer.send(message)
                consumer.send(receive(producer, "CPU time from the producer", STEP_S))
            sent = bridge_bytes(host1) - sent_before
            producer.send("done")
        rows = message
        hosts = {role: {"name": h.name, "address": h.address} for role, h in (("producer", host1), ("consumer", host2))}
    write_results(
        args,
        rows,
        METHOD,
        label=f"{args.name}-cross-host",
        net="TCP between the two hosts",
        notes=[
            "- raw TCP: the same byte count through one plain TCP socket from host 1 to host 2",
            f"  ({args.chunk_bytes >> 20} MiB sendall slices of a {SENDER_BUFFER >> 20} MiB buffer, recv_into a "
            "destination of the full size on 2 MiB pages), no framing: the network path's ceiling.",
            *(
                [
                    "- raw Mooncake: the same byte count read with Mooncake's transfer engine (the KV server's "
                    f"own on host 1) in single-descriptor reads of up to {MOONCAKE_READ >> 20} MiB from one "
                    "registered buffer into a registered destination on 2 MiB pages: Mooncake's best case."
                ]
                if uses_mooncake(args.transports)
                else []
            ),
            f"- producer on {hosts['producer']['address']} ({host1.name}), consumer on "
            f"{hosts['consumer']['address']} ({host2.name}), KV server (control, every transport) "
            f"{addresses[0]}; host 1 put {sent / 2**30:.1f} GiB on the bridge during the run.",
            "- shm: not measured; it needs both caches on one host (shared memory, process_vm_readv/writev).",
        ],
        mode="cross-host",
        hosts=hosts,
        endpoint=addresses[0],
        bridge_bytes_from_producer_host=sent,
    )
    return 0
