"""KV transfer benchmark: cache-to-cache over the connector's transport vs plain memcpy.

A producer process holds a paged KV cache of a realistic layout (default: a 7B-class model, 28
layers, 4 KV heads, head dim 128, bf16, block size 16) and serves it through the real transport
server; this process pulls a request's blocks (scattered block ids on both sides) into its own
cache through the real client and scatterer. In the same run it times `memcpy` (ctypes.memmove,
one thread) of the same number of bytes, and an in-process gather+scatter (staging alone, no
transport) to show where time goes. With --cross-host the producer and this side run on two test
hosts (network namespaces, see bench/kv_transfer_hosts.py), next to a raw TCP stream between them.

Transports: grpc; shm (direct cross-process copies where the OS allows, as the connector does);
shm with --shm-ring (forces the shared-memory ring: gather into slots, scatter out, pipelined);
collective (gloo point-to-point on CPU); mooncake (Mooncake's transfer engine, TCP: the consumer
reads the producer's registered cache into its own, in place where the runs of blocks are long,
else staged: gathered into chunks of one descriptor each); mooncake-in-place and mooncake-staged
(the same backend always reading in place, what it did before, or always staged). Several at once (`--transport grpc
mooncake`): one producer serves them all, each round of repeats pulls once through each in
turn, and the memcpy, staging and ceilings are timed once per token count for all of them.
Results: bench/results/<date>-kv-transfer-<transports joined by '-'>[-cross-host].{json,md},
a row per token count and transport, with its ratio to grpc's when grpc is in the run. The
issues' targets are reported met or missed; they never fail the run.

Usage: python bench/kv_transfer.py [--tokens 1024 8192 32768] [--repeats 5]
       [--transport grpc|shm|collective|mooncake[-in-place|-staged] [...]] [--shm-ring]
       [--cross-host (root; not shm)]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_transfer_results import result_name, write_results  # noqa: E402
from pdcluster.errors import KVTransferError  # noqa: E402
from pdcluster.kv_transfer.kv_cache import PagedKVCache, huge_pages  # noqa: E402
from pdcluster.kv_transfer.producer import KVProducer  # noqa: E402
from pdcluster.kv_transfer.settings import KVTransferSettings  # noqa: E402
from pdcluster.kv_transfer.staging import BlockGatherer, BlockScatterer  # noqa: E402
from pdcluster.kv_transfer.transports import create_transport, serve_backends  # noqa: E402
from pdcluster.kv_transfer.transports.base import CacheSink  # noqa: E402
from pdcluster.kv_transfer.transports.mooncake_engine import run_starts  # noqa: E402

SECRET = "bench-secret"
TRANSPORTS = ("grpc", "shm", "collective", "mooncake", "mooncake-in-place", "mooncake-staged")
VARIANTS = {  # name -> (backend, its mooncake settings): one backend's read modes side by side
    "mooncake-in-place": ("mooncake", {"in_place_min_run_bytes": 0}),
    "mooncake-staged": ("mooncake", {"in_place_min_run_bytes": 1 << 60}),
}
ROUNDS = (
    "median of repeats (each round pulls once through each transport in turn, each pull followed "
    "by one memcpy; the memcpy median is over all of a token count's pulls)"
)
METHOD = (
    f"{ROUNDS}; cache-to-cache pull between two processes on 127.0.0.1, both "
    "caches on 2 MiB pages as the connector backs them; memcpy = ctypes.memmove of the same "
    "byte count between two buffers on 2 MiB pages, one thread, same run"
)


def make_cache(layers, kv_heads, head_dim, block_size, num_blocks, fill) -> PagedKVCache:
    """fill: the same random bytes in every process (seeded per layer), else zeros."""
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    tensors = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16)
        if fill:
            t.view(torch.int16).random_(-(2**15), 2**15 - 1, generator=torch.Generator().manual_seed(i))
        else:
            t.zero_()
        tensors[f"model.layers.{i}.self_attn.attn"] = t
    cache = PagedKVCache(tensors, model="bench-7b", block_size=block_size)
    cache.back_with_huge_pages()  # as the connector does when vLLM registers its cache
    return cache


def same_blocks(a: PagedKVCache, a_ids: list[int], b: PagedKVCache, b_ids: list[int]) -> bool:
    a_index, b_index = torch.tensor(a_ids), torch.tensor(b_ids)
    return all(
        torch.equal(x.view(torch.int16)[a_index], y.view(torch.int16)[b_index]) for x, y in zip(a.tensors, b.tensors)
    )


def scattered_ids(num_blocks: int, n: int, seed: int, contiguous: bool = False) -> list[int]:
    """`n` block ids: a random permutation's first `n` (a fragmented cache), or with
    `contiguous` a run of `n` consecutive ids from a seeded start (a fresh one)."""
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        start = int(torch.randint(num_blocks - n + 1, (1,), generator=gen))
        return list(range(start, start + n))
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def pull_plan(args) -> tuple[int, dict[str, list[int]]]:
    """The caches' block count and each request's source block ids (both sides agree)."""
    num_blocks = -(-max(args.tokens) // args.block_size) + 64
    requests = {
        f"req-{t}": scattered_ids(num_blocks, -(-t // args.block_size), seed=t, contiguous=args.contiguous)
        for t in args.tokens
    }
    return num_blocks, requests


def variant(transport: str) -> tuple[str, dict]:
    """The backend a transport name runs and its mooncake settings (VARIANTS; else itself, none)."""
    return VARIANTS.get(transport, (transport, {}))


def backend_of(transport: str) -> str:
    return variant(transport)[0]


def uses_mooncake(transports) -> bool:
    return any(backend_of(t) == "mooncake" for t in transports)


def transport_settings(args, transport: str = "grpc") -> KVTransferSettings:
    """This side's transport settings: bound to and advertised on its own address."""
    return KVTransferSettings(
        secret=args.secret,
        max_chunk_bytes=args.chunk_bytes,
        bind_host=args.host,
        advertise_host=args.host,
        mooncake=variant(transport)[1],
    )


@contextlib.contextmanager
def serving(args, num_blocks: int, requests: dict[str, list[int]]):
    """A prefill engine's cache with leased blocks, served by every listed transport on one control
    server on args.host (and the raw gRPC ceiling next to it when grpc is listed); yields
    (control server address, raw gRPC address or None)."""
    cache = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, True)
    producer = KVProducer(cache, "bench-prefill", max_chunk_bytes=args.chunk_bytes)
    for request_id, ids in requests.items():
        producer.leases.add(request_id, ids, time.monotonic() + 3600)
    backends = list(dict.fromkeys(backend_of(t) for t in args.transports))
    server = serve_backends(backends, transport_settings(args), producer, args.host, 0)
    raw = raw_grpc_server(args.chunk_bytes, f"{args.host}:0") if "grpc" in args.transports else None
    try:
        yield server.address, raw[1] if raw else None
    finally:
        server.stop(0)
        if raw:
            raw[0].stop(0).wait()


def answer_rusage(conn) -> None:
    """The producer's side of the CPU accounting: its CPU seconds on each ask, until "done"."""
    while conn.recv() == "rusage":
        conn.send(cpu_seconds())


def producer_main(conn, args, num_blocks, requests):
    """Child process: a prefill engine's cache with leased blocks, served by the transports."""
    torch.set_num_threads(1)
    with serving(args, num_blocks, requests) as addresses:
        conn.send(addresses)
        answer_rusage(conn)


def raw_grpc_server(chunk_bytes: int, bind: str = "127.0.0.1:0"):
    """The gRPC ceiling: stream fresh chunk-sized messages copied from a large buffer (no KV
    layout, gather, lease or encoding work), with the transport's own channel options.
    `bind`: a host:port, or `unix:PATH` for a Unix-domain socket; returns (server, address)."""
    from concurrent import futures

    import grpc

    from pdcluster.kv_transfer.transports.rpc import server_options

    source = torch.empty(1 << 30, dtype=torch.uint8).random_()
    settings = KVTransferSettings(secret=SECRET, max_chunk_bytes=chunk_bytes)

    def stream(request: bytes, context):
        total = int(request)
        sent = 0
        while sent < total:
            n = min(chunk_bytes, total - sent)
            offset = sent % (source.numel() - n)
            yield source[offset : offset + n].numpy().tobytes()
            sent += n

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=bytes, response_serializer=bytes)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(settings))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(bind)
    server.start()
    return server, bind if bind.startswith("unix:") else f"{bind.rsplit(':', 1)[0]}:{port}"


def time_raw_grpc(address: str, nbytes: int, chunk_bytes: int, repeats: int, extra_options=()) -> float:
    import grpc

    from pdcluster.kv_transfer.transports.rpc import client_options

    options = client_options(KVTransferSettings(secret=SECRET, max_chunk_bytes=chunk_bytes)) + list(extra_options)
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_stream("/bench.Raw/Stream", request_serializer=bytes, response_deserializer=bytes)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            got = sum(len(m) for m in call(str(nbytes).encode()))
            times.append(time.perf_counter() - t0)
            assert got == nbytes
    return statistics.median(times[1:])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Memcpy:
    """The baseline: one-thread memmove of `nbytes` between two buffers on 2 MiB pages."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.dst = torch.empty(nbytes, dtype=torch.uint8)
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), nbytes)  # fault pages in
        huge_pages([self.src, self.dst])  # the same 2 MiB pages the caches get

    def time_once(self) -> float:
        t0 = time.perf_counter()
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)
        return time.perf_counter() - t0


def time_staging(src: PagedKVCache, dst: PagedKVCache, src_ids, dst_ids, chunk, repeats) -> float:
    gatherer, scatterer = BlockGatherer(src, chunk), BlockScatterer(dst, chunk)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        scatterer.begin(dst_ids)
        for c, data in gatherer.chunks(src_ids):
            scatterer.write(c, data)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=KVTransferSettings().max_chunk_bytes)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--transport", dest="transports", nargs="+", default=["grpc"], choices=TRANSPORTS, help="one or more"
    )
    parser.add_argument("--shm-ring", action="store_true", help="shm: force the shared ring")
    parser.add_argument(
        "--contiguous", action="store_true", help="consecutive block ids on both sides (default: scattered)"
    )
    parser.add_argument("--target", type=float, default=None, help="ratio to memcpy to meet (every transport)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--cross-host", action="store_true", help="producer and consumer on two test hosts (root)")
    parser.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)  # --cross-host's sides
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)  # the address a side binds
    args = parser.parse_args(argv)
    args.transports = list(dict.fromkeys(args.transports))
    if args.shm_ring and "shm" not in args.transports:
        parser.error("--shm-ring forces shm's ring: list shm in --transport")
    if args.cross_host and "shm" in args.transports:
        parser.error("--cross-host: shm moves bytes within one host only; use grpc, collective or mooncake")
    args.mode = "cross-host" if args.cross_host else "single-host"
    args.name = "-".join(result_name(args, t) for t in args.transports) + ("-contiguous" if args.contiguous else "")
    args.secret = SECRET
    args.load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    if args.cross_host:
        from bench.kv_transfer_hosts import cross_host_main

        return cross_host_main(args, sys.argv[1:] if argv is None else argv)

    num_blocks, requests = pull_plan(args)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child, args, num_blocks, requests))
    proc.start()
    child.close()  # the child has its copy: its exit ends our recv (EOFError) instead of a hang
    try:
        address, raw_address = parent.recv()
        rows = run_pulls(args, address, raw_address, num_blocks, requests, parent)
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    write_results(args, rows, METHOD)
    return 0


class Consumer:
    """This side: its cache, a copy of the producer's (pulls are checked against it), and a
    handshaken client per transport, all landing through one scatterer."""

    def __init__(self, args, address: str, num_blocks: int, producer):
        self.args, self.producer = args, producer  # producer: the pipe that answers "rusage"
        self.local = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, False)
        self.source = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, True)
        self.scatterer = BlockScatterer(self.local, args.chunk_bytes)
        self.clients, self.sinks = {}, {}
        try:
            for transport in args.transports:
                name = result_name(args, transport)
                settings = transport_settings(args, transport)
                self.clients[name] = create_transport(backend_of(transport), settings).connect(address)
                self.clients[name].handshake(self.local.layout, "bench-decode")
                # A plain callable sink never offers the cache for direct copies: shm uses its ring.
                self.sinks[name] = self.scatterer.write if name == "shm-ring" else CacheSink(self.scatterer)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def time_pulls(self, request_id: str, src_ids: list[int], dst_ids: list[int]) -> tuple[dict, dict, dict, float]:
        """Rounds of one pull through each client in turn, a memcpy after each. Each client's
        first pull warms its channel and pages, untimed, into zeroed blocks then checked against
        the producer's. Returns each client's median seconds, its CPU cores busy (both processes'
        CPU time per wall second of transfer: 2.0 = both cores busy), the errors of the clients
        whose pull failed (not asked again for this request), and the memcpy median."""
        tokens = len(src_ids) * self.args.block_size
        nbytes = len(src_ids) * self.local.layout.bytes_per_block()
        memcpy = Memcpy(nbytes)
        times = {name: [] for name in self.clients}
        cpu = dict.fromkeys(self.clients, 0.0)
        memcpy_times, failed = [], {}
        # Small pulls take milliseconds: repeat them more so each row's medians rest on ~as many
        # bytes; a memcpy after every pull, so all see the same moments of this shared machine.
        for i in range(self.args.repeats * max(1, 8192 // tokens) + 1):
            for name, client in self.clients.items():
                if name in failed:
                    continue
                if not i:
                    for t in self.local.tensors:
                        t.view(torch.int16).index_fill_(0, torch.tensor(dst_ids), 0)
                cpu_start = self.cpu_seconds()
                t0 = time.perf_counter()
                self.scatterer.begin(dst_ids)
                try:
                    got = client.pull(request_id, src_ids, self.sinks[name], engine_id="bench", timeout_s=600)
                except KVTransferError as exc:  # a failed pull is a result: in the row, and the run goes on
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    times.pop(name)
                    continue
                elapsed = time.perf_counter() - t0
                cpu_s = self.cpu_seconds() - cpu_start
                if got != nbytes:
                    raise RuntimeError(f"{name}: pulled {got} bytes of {nbytes}")
                copy_s = memcpy.time_once()
                if i:
                    times[name].append(elapsed)
                    cpu[name] += cpu_s
                    memcpy_times.append(copy_s)
                elif not same_blocks(self.source, src_ids, self.local, dst_ids):
                    raise RuntimeError(f"{name}: the pulled blocks of {request_id} differ from the producer's")
        medians = {name: statistics.median(t) for name, t in times.items()}
        busy = {name: cpu[name] / sum(times[name]) for name in times}
        return medians, busy, failed, statistics.median(memcpy_times or [memcpy.time_once()])

    def cpu_seconds(self) -> float:
        """This process's CPU seconds and the producer's."""
        self.producer.send("rusage")
        return cpu_seconds() + self.producer.recv()


def block_runs(src_ids: list[int], dst_ids: list[int]) -> int:
    """Runs of blocks consecutive on both sides (mooncake reads one descriptor per run per layer)."""
    return len(run_starts(src_ids, dst_ids))


def over(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is missing (a ceiling not measured, a pull that failed)."""
    return a / b if a and b else None


def run_pulls(
    args,
    address: str,
    raw_address: str | None,
    num_blocks: int,
    requests: dict[str, list[int]],
    producer,
    ceilings: dict[str, Callable[[int], float]] | None = None,
) -> list[dict]:
    """Time each request's pull through each transport, memcpy, staging alone and the ceilings
    (raw gRPC when raw_address is set; `ceilings`: more, name -> seconds to move n bytes) of the
    same byte count. Returns a row per token count and transport."""
    consumer = Consumer(args, address, num_blocks, producer)
    rows = []
    try:
        for tokens in args.tokens:
            src_ids = requests[f"req-{tokens}"]
            dst_ids = scattered_ids(num_blocks, len(src_ids), seed=tokens + 1, contiguous=args.contiguous)
            nbytes = len(src_ids) * consumer.local.layout.bytes_per_block()
            times, cpu, failed, memcpy_s = consumer.time_pulls(f"req-{tokens}", src_ids, dst_ids)
            staging_s = time_staging(consumer.source, consumer.local, src_ids, dst_ids, args.chunk_bytes, args.repeats)
            ceiling_s = {
                "grpc": time_raw_grpc(raw_address, nbytes, args.chunk_bytes, args.repeats) if raw_address else None
            }
            ceiling_s.update({name: timer(nbytes) for name, timer in (ceilings or {}).items()})
            for name, client in consumer.clients.items():
                transfer_s = times.get(name)
                reads = getattr(client, "reads", None)  # mooncake: its pulls by read mode so far
                row = {
                    "tokens": tokens,
                    "bytes": nbytes,
                    "transport": name,
                    "block_runs": block_runs(src_ids, dst_ids),
                    "error": failed.get(name),
                    "transfer_s": transfer_s,
                    "transfer_GBps": over(nbytes / 1e9, transfer_s),
                    "memcpy_GBps": nbytes / memcpy_s / 1e9,
                    "staging_only_GBps": nbytes / staging_s / 1e9,
                    "ratio_to_memcpy": over(memcpy_s, transfer_s),
                    "ratio_to_grpc": over(times.get("grpc"), transfer_s),
                    "cpu_cores_busy": cpu.get(name),
                    "read_modes": dict(reads) if reads is not None else None,
                }
                if reads is not None:
                    reads.clear()  # each row counts its own pulls
                for ceiling, seconds in ceiling_s.items():
                    row[f"raw_{ceiling}_GBps"] = over(nbytes / 1e9, seconds)
                    row[f"ratio_to_raw_{ceiling}"] = over(seconds, transfer_s)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        consumer.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
