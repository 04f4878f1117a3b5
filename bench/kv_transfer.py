"""KV transfer benchmark: cache-to-cache over the connector's transport vs plain memcpy.

A producer process holds a paged KV cache of a realistic layout (default: a 7B-class model, 28
layers, 4 KV heads, head dim 128, bf16, block size 16) and serves it through the real transport
server; this process pulls a request's blocks (scattered block ids on both sides) into its own
cache through the real client and scatterer. In the same run it times `memcpy` (ctypes.memmove,
one thread) of the same number of bytes, and an in-process gather+scatter (staging alone, no
transport) to show where time goes. Results: bench/results/<date>-kv-transfer-<transport>.{json,md}.
With --cross-host the producer and this side run on two test hosts (network namespaces, see
bench/kv_transfer_hosts.py), next to a raw TCP stream between the same hosts.

Transports: grpc; shm (direct cross-process copies where the OS allows, as the connector does);
shm with --shm-ring (forces the shared-memory ring: gather into slots, scatter out, pipelined);
collective (gloo point-to-point on CPU).

Usage: python bench/kv_transfer.py [--tokens 1024 8192 32768] [--repeats 5]
       [--transport grpc|shm|collective] [--shm-ring] [--cross-host (root; grpc, collective)]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdcluster.kv_transfer.kv_cache import PagedKVCache, huge_pages  # noqa: E402
from pdcluster.kv_transfer.producer import KVProducer  # noqa: E402
from pdcluster.kv_transfer.settings import KVTransferSettings  # noqa: E402
from pdcluster.kv_transfer.staging import BlockGatherer, BlockScatterer  # noqa: E402
from pdcluster.kv_transfer.transports import create_transport  # noqa: E402
from pdcluster.kv_transfer.transports.base import CacheSink  # noqa: E402

SECRET = "bench-secret"
TARGETS = {"grpc": 0.25, "shm": 0.6}  # issue 3 and issue 8; collective has none on CPU
HOW = {
    "grpc": "grpc: gather on the producer, encode, stream, decode, scatter into scattered block ids.",
    "shm": "shm (direct): the producer writes half the layers into the consumer's cache while the "
    "consumer reads the other half from the producer's (process_vm_writev/readv), one copy per "
    "byte; gRPC carries control only.",
    "shm-ring": "shm ring: the producer gathers chunks into a ring of 4 slots in /dev/shm while the "
    "consumer scatters earlier chunks out of it (2 copies per byte, pipelined on 2 processes).",
    "collective": "collective: gloo send/recv on a pair group over 127.0.0.1 TCP, gather into and "
    "scatter out of double buffers; gRPC carries control only.",
}
CEILINGS = {"grpc": "raw gRPC", "tcp": "raw TCP"}  # row key raw_<name>_GBps -> column label
METHOD = (
    "median of repeats (each pull followed by one memcpy); cache-to-cache pull between two processes on 127.0.0.1, both "
    "caches on 2 MiB pages as the connector backs them; memcpy = ctypes.memmove of the same "
    "byte count between two buffers on 2 MiB pages, one thread, same run"
)


def make_cache(layers, kv_heads, head_dim, block_size, num_blocks, fill) -> PagedKVCache:
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    tensors = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16)
        if fill:
            t.view(torch.int16).random_(-(2**15), 2**15 - 1)
        else:
            t.zero_()
        tensors[f"model.layers.{i}.self_attn.attn"] = t
    cache = PagedKVCache(tensors, model="bench-7b", block_size=block_size)
    cache.back_with_huge_pages()  # as the connector does when vLLM registers its cache
    return cache


def scattered_ids(num_blocks: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def pull_plan(args) -> tuple[int, dict[str, list[int]]]:
    """The caches' block count and each request's scattered source block ids (both sides agree)."""
    num_blocks = -(-max(args.tokens) // args.block_size) + 64
    requests = {f"req-{t}": scattered_ids(num_blocks, -(-t // args.block_size), seed=t) for t in args.tokens}
    return num_blocks, requests


def transport_settings(args) -> KVTransferSettings:
    """This side's transport settings: bound to and advertised on its own address."""
    return KVTransferSettings(
        secret=args.secret, max_chunk_bytes=args.chunk_bytes, bind_host=args.host, advertise_host=args.host
    )


@contextlib.contextmanager
def serving(args, num_blocks: int, requests: dict[str, list[int]]):
    """A prefill engine's cache with leased blocks, served by the transport on args.host (and the
    raw gRPC ceiling next to it for grpc); yields (transport address, raw gRPC address or None)."""
    cache = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, True)
    producer = KVProducer(cache, "bench-prefill", max_chunk_bytes=args.chunk_bytes)
    for request_id, ids in requests.items():
        producer.leases.add(request_id, ids, time.monotonic() + 3600)
    transport = create_transport(args.transport, transport_settings(args))
    server = transport.serve(producer, args.host, 0)
    raw = raw_grpc_server(args.chunk_bytes, f"{args.host}:0") if args.transport == "grpc" else None
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
    """Child process: a prefill engine's cache with leased blocks, served by the transport."""
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
    parser.add_argument("--transport", default="grpc", choices=["grpc", "shm", "collective"])
    parser.add_argument("--shm-ring", action="store_true", help="shm: force the shared ring")
    parser.add_argument("--target", type=float, default=None, help="ratio to memcpy to meet")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--cross-host", action="store_true", help="producer and consumer on two test hosts (root)")
    parser.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)  # --cross-host's sides
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)  # the address a side binds
    args = parser.parse_args(argv)
    if args.cross_host and (args.transport == "shm" or args.shm_ring):
        parser.error("--cross-host: shm moves bytes within one host only; use grpc or collective")
    if args.target is None and not args.cross_host:  # the targets are same-host ones
        args.target = TARGETS.get(args.transport)
    args.name = args.transport + ("-ring" if args.shm_ring else "")
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
    write_results(args, rows)
    return 0


def run_pulls(
    args,
    address: str,
    raw_address: str | None,
    num_blocks: int,
    requests: dict[str, list[int]],
    producer,
    ceilings: dict[str, Callable[[int], float]] | None = None,
) -> list[dict]:
    """Time each request's pull, memcpy, staging alone and the ceilings (raw gRPC when raw_address
    is set; `ceilings`: more, name -> seconds to move n bytes) of the same byte count."""
    local = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, False)
    source = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks, True)
    transport = create_transport(args.transport, transport_settings(args))
    client = transport.connect(address)
    client.handshake(local.layout, "bench-decode")
    scatterer = BlockScatterer(local, args.chunk_bytes)
    # A plain callable sink never offers the cache for direct copies, so shm uses its ring.
    sink = scatterer.write if args.shm_ring else CacheSink(scatterer)

    rows = []
    for tokens in args.tokens:
        request_id = f"req-{tokens}"
        src_ids = requests[request_id]
        dst_ids = scattered_ids(num_blocks, len(src_ids), seed=tokens + 1)
        nbytes = len(src_ids) * local.layout.bytes_per_block()
        memcpy = Memcpy(nbytes)
        times, memcpy_times = [], []
        cpu = 0.0
        # Small pulls take milliseconds: repeat them more so each row's medians rest on ~as many
        # bytes; a memcpy after every pull, so both see the same moments of this shared machine.
        repeats = args.repeats * max(1, 8192 // tokens)
        for i in range(repeats + 1):  # first pull warms the channel and the pages
            producer.send("rusage")
            cpu_start = cpu_seconds() + producer.recv()
            t0 = time.perf_counter()
            scatterer.begin(dst_ids)
            got = client.pull(request_id, src_ids, sink, engine_id="bench", timeout_s=600)
            times.append(time.perf_counter() - t0)
            producer.send("rusage")
            if i:
                cpu += cpu_seconds() + producer.recv() - cpu_start
            else:
                producer.recv()
            assert got == nbytes
            memcpy_times.append(memcpy.time_once())
        transfer_s = statistics.median(times[1:])
        memcpy_s = statistics.median(memcpy_times[1:])
        del memcpy
        staging_s = time_staging(source, local, src_ids, dst_ids, args.chunk_bytes, args.repeats)
        raw_s = time_raw_grpc(raw_address, nbytes, args.chunk_bytes, args.repeats) if raw_address else None
        row = {
            "tokens": tokens,
            "bytes": nbytes,
            "transfer_s": transfer_s,
            "transfer_GBps": nbytes / transfer_s / 1e9,
            "memcpy_GBps": nbytes / memcpy_s / 1e9,
            "staging_only_GBps": nbytes / staging_s / 1e9,
            "ratio_to_memcpy": memcpy_s / transfer_s,
            "raw_grpc_GBps": nbytes / raw_s / 1e9 if raw_s else None,
            "ratio_to_raw_grpc": raw_s / transfer_s if raw_s else None,
            # both processes' CPU time per wall second of transfer (2.0 = both cores busy)
            "cpu_cores_busy": cpu / sum(times[1:]),
        }
        for name, timer in (ceilings or {}).items():
            ceiling_s = timer(nbytes)
            row[f"raw_{name}_GBps"] = nbytes / ceiling_s / 1e9
            row[f"ratio_to_raw_{name}"] = ceiling_s / transfer_s
        rows.append(row)
        print(json.dumps(row), flush=True)

    client.close()
    return rows


def write_results(args, rows: list[dict], label=None, method=METHOD, how=None, notes=(), **extra) -> None:
    """bench/results/<date>-kv-transfer-<label>.{json,md}. label, how: default the transport's
    name and HOW line; `notes`: more lines under the table; `extra`: more top-level JSON keys."""
    label = label or args.name
    stamp = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = [name for name in CEILINGS if f"raw_{name}_GBps" in rows[0]]
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "transport": args.name,
        **extra,
        "layout": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": "bfloat16",
            "chunk_bytes": args.chunk_bytes,
        },
        "machine": {
            "cpus": mp.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            # the machine is shared: 1-minute load average before and after the run
            "loadavg_1m": [args.load_before, os.getloadavg()[0]],
        },
        "method": method,
        "rows": rows,
    }
    name = f"{stamp}-kv-transfer-{label}"
    (args.out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    heads = "".join(f" {CEILINGS[c]} GB/s | transfer / {CEILINGS[c]} |" for c in ceilings)
    lines = [
        f"# KV transfer benchmark ({label}), {meta['date']}",
        "",
        f"Layout: {args.layers} layers, {args.kv_heads} KV heads, head dim {args.head_dim}, bf16, "
        f"block size {args.block_size}; chunks of {args.chunk_bytes >> 20} MiB. {meta['method']}. "
        f"Machine: {meta['machine']['cpus']} CPUs, shared; 1-min load average "
        f"{meta['machine']['loadavg_1m'][0]:.1f} before, {meta['machine']['loadavg_1m'][1]:.1f} after.",
        "",
        f"| tokens | MiB | transfer GB/s | memcpy GB/s | transfer / memcpy |{heads} staging only GB/s | CPU cores busy |",
        "|---:|---:|---:|---:|---:|" + "---:|---:|" * len(ceilings) + "---:|---:|",
    ]
    for r in rows:
        raw = " | ".join(
            f"{r[f'raw_{c}_GBps']:.2f} | {r[f'ratio_to_raw_{c}']:.2f}x" if r[f"raw_{c}_GBps"] else "- | -"
            for c in ceilings
        )
        lines.append(
            f"| {r['tokens']} | {r['bytes'] / 2**20:.0f} | {r['transfer_GBps']:.2f} | "
            f"{r['memcpy_GBps']:.2f} | **{r['ratio_to_memcpy']:.2f}x** | {raw} | {r['staging_only_GBps']:.2f} | "
            f"{r['cpu_cores_busy']:.2f} |"
        )
    worst = min(r["ratio_to_memcpy"] for r in rows)
    if args.target is not None:
        verdict = "met" if worst >= args.target else "MISSED"
        lines += ["", f"Target transfer / memcpy >= {args.target}x: **{verdict}** (worst row {worst:.2f}x)."]
    else:
        lines += ["", f"No target for this transport; worst row {worst:.2f}x memcpy."]
    lines += [
        "",
        "- transfer: cache-to-cache pull through the connector's transport (handshake done once).",
        f"  {how or HOW[args.name]}",
        "- raw gRPC: the same byte count as fresh chunk-sized messages through grpcio with the",
        "  same channel options and no KV work — the ceiling any gRPC transport can reach here.",
        "- staging only: gather + scatter in one process (no transport).",
        "- CPU cores busy: user+system CPU of producer and consumer per second of transfer.",
        *notes,
    ]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / name}.md")


if __name__ == "__main__":
    sys.exit(main())
