"""Exercise the mooncake backend's staged read on an accelerator host (CUDA, or Ascend via
torch_npu). Not run in CI: this repository's machines have no accelerator.

A producer process holds a paged KV cache on the device, written on the compute stream, and
leases a request's blocks with the event recorded after that write; it serves `grpc` and
`mooncake` from one control server on 127.0.0.1. This process, with a cache on the device too,
pulls the blocks through the real clients of both backends, in turn, each pull into scattered
block ids:
1. correctness: every block arrives intact (mooncake: staged, the producer gathering each chunk
   into a registered host slot on a side stream that waits on the lease's event, the consumer
   landing it in a registered buffer and scattering it to the device on a side stream);
2. no hidden synchronisation: on CUDA both processes run their pulls under
   torch.cuda.set_sync_debug_mode("error"), which raises on .item()/.tolist()/.cpu()/
   device-wide syncs (waiting on one slot's event is the design);
3. bytes/s of the mooncake pull against the grpc pull, same run: staged at each
   --staging-chunk-bytes, and, where the Mooncake build registers device memory (its CUDA or NPU
   wheel), read in place between the two device caches; for reference, the same pull between
   two host caches (mooncake reading in place).

Usage: python tools/kv_mooncake_device_check.py [--tokens 8192 32768] [--layers 28]
       [--staging-chunk-bytes 33554432 [...]] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from kv_collective_device_check import make_cache  # noqa: E402
from kv_collective_device_check import settings as plain_settings  # noqa: E402

from pdcluster.kv_transfer.producer import KVProducer  # noqa: E402
from pdcluster.kv_transfer.staging import BlockScatterer, DeviceContext  # noqa: E402
from pdcluster.kv_transfer.transports import create_transport, serve_backends  # noqa: E402
from pdcluster.kv_transfer.transports.base import CacheSink  # noqa: E402
from pdcluster.kv_transfer.transports.mooncake import in_place  # noqa: E402
from pdcluster.kv_transfer.transports.mooncake_engine import build, registers, unavailable  # noqa: E402

BACKENDS = ["grpc", "mooncake"]
CHUNK = 4 << 20


def settings(staging_chunk_bytes: int, register: bool = True):
    base = plain_settings()
    mooncake = {"staging_chunk_bytes": staging_chunk_bytes, "device_memory": "register" if register else "stage"}
    return base.model_copy(update={"mooncake": base.mooncake.model_copy(update=mooncake)})


def strict_sync(device: torch.device) -> None:
    """From here on, a hidden synchronisation on CUDA raises."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")


def producer_main(
    conn, device: str, layers: int, num_blocks: int, ids: list[int], staging: int, register: bool
) -> None:
    dev = torch.device(device)
    if dev.type != "cpu":
        torch.accelerator.set_device_index(dev.index or 0)
    cache = make_cache(device, layers, num_blocks, seed=1)
    ready = DeviceContext(dev).record_compute_event()  # the "forward pass" that wrote the blocks
    producer = KVProducer(cache, "check-prefill", max_chunk_bytes=CHUNK)
    producer.leases.add("check", ids, time.monotonic() + 3600, ready_event=ready)
    server = serve_backends(BACKENDS, settings(staging, register), producer, "127.0.0.1", 0, dev.type)
    strict_sync(dev)
    conn.send(server.address)
    conn.recv()
    server.stop(0)


def pull_once(client, local, src_ids, dst_ids) -> tuple[int, float]:
    """One pull into `local` under strict synchronisation, timed until its last scatter ended."""
    scatterer = BlockScatterer(local, CHUNK)
    strict_sync(local.device)
    try:
        scatterer.begin(dst_ids)
        start = time.perf_counter()
        nbytes = client.pull("check", src_ids, CacheSink(scatterer), engine_id="check-decode", timeout_s=300)
        done = scatterer.finish()
        if done is not None:
            done.synchronize()  # timing only: the engine's compute stream would wait on it instead
        return nbytes, time.perf_counter() - start
    finally:
        if local.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def pair(device: str, tokens: int, layers: int, repeats: int, staging: int, register: bool) -> dict:
    """One producer process, both backends pulled in turn, `repeats` rounds (the first a warm-up)."""
    num_blocks = -(-tokens // 16) + 8
    n = -(-tokens // 16)
    gen = torch.Generator().manual_seed(tokens)
    src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child, device, layers, num_blocks, src_ids, staging, register))
    proc.start()
    dev = torch.device(device)
    expected = make_cache("cpu", layers, num_blocks, seed=1)
    result: dict = {"device": device, "tokens": tokens, "staging_chunk_bytes": staging}
    try:
        address = parent.recv()
        local = make_cache(device, layers, num_blocks, seed=None)
        result["mooncake_read"] = "in place" if in_place(local.tensors, settings(staging, register)) else "staged"
        clients = {
            name: create_transport(name, settings(staging, register), dev.type).connect(address) for name in BACKENDS
        }
        for client in clients.values():
            client.handshake(local.layout, "check-decode")
        times: dict[str, list[float]] = {name: [] for name in BACKENDS}
        intact = dict.fromkeys(BACKENDS, True)
        for _ in range(repeats):
            for name, client in clients.items():
                for layer in local.tensors:
                    layer.zero_()
                nbytes, seconds = pull_once(client, local, src_ids, dst_ids)
                times[name].append(seconds)
                intact[name] &= all(
                    torch.equal(dst[dst_ids].cpu(), src[src_ids]) for src, dst in zip(expected.tensors, local.tensors)
                )
        result["intact"] = intact
        for client in clients.values():
            client.close()
    finally:
        parent.send("stop")
        proc.join(60)
    result["bytes"] = nbytes
    for name, seconds in times.items():
        best = min(seconds[1:] or seconds)
        result[f"{name}_GBps"] = round(nbytes / best / 1e9, 3)
    result["mooncake_vs_grpc"] = round(result["mooncake_GBps"] / result["grpc_GBps"], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--staging-chunk-bytes", type=int, nargs="+", default=[32 << 20], help="device pairs: one per size"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report: dict = {"mooncake_unavailable": unavailable()}
    if report["mooncake_unavailable"] is None:
        sizes = args.staging_chunk_bytes
        runs = [("cpu", sizes[0], True)]  # host caches: read in place
        if torch.accelerator.is_available():
            kind = torch.accelerator.current_accelerator().type
            staged = [(f"{kind}:0", size, False) for size in sizes]
            runs = staged + ([(f"{kind}:0", sizes[-1], True)] if registers(kind) else []) + runs
        report["mooncake_build"] = build()
        report["pairs"] = [
            pair(device, tokens, args.layers, args.repeats, size, register)
            for device, size, register in runs
            for tokens in args.tokens
        ]
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        args.json.write_text(text + "\n")
    pairs = report.get("pairs", [])
    ok = bool(pairs) and all(all(p["intact"].values()) for p in pairs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
