"""Exercise the collective KV backend's device path on an accelerator host (NCCL on CUDA, HCCL on
Ascend via torch_npu). Not run in CI: this repository's machines have no accelerator.

1. Staging with events: runs tools/kv_staging_device_check.py (gather/scatter with side streams
   and events, no hidden synchronisation) unless --skip-staging.
2. Pair transfer, when the host has two devices: a producer process with a paged cache on device
   0 serves leased blocks through the real control server (the collective extension); this
   process, with a cache on device 1, pulls them through the real CollectiveClient (NCCL/HCCL
   send/recv between the two devices, scatter on a side stream), checks every block arrived
   intact, and times the pull against a device-to-device copy of the same bytes. With one
   device it says so and skips this part (NCCL cannot pair two ranks on one device).

Usage: python tools/kv_collective_device_check.py [--tokens 8192] [--layers 28] [--json OUT]
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

from pdcluster.kv_transfer.kv_cache import PagedKVCache  # noqa: E402
from pdcluster.kv_transfer.producer import KVProducer  # noqa: E402
from pdcluster.kv_transfer.settings import KVTransferSettings  # noqa: E402
from pdcluster.kv_transfer.staging import BlockScatterer  # noqa: E402
from pdcluster.kv_transfer.transports import create_transport, serve_backends  # noqa: E402
from pdcluster.kv_transfer.transports.base import CacheSink  # noqa: E402

SECRET = "device-check"
BLOCK, KV_HEADS, HEAD_DIM = 16, 4, 128


def make_cache(device: str, layers: int, num_blocks: int, seed: int | None) -> PagedKVCache:
    tensors = {}
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for i in range(layers):
        shape = (num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM)
        if gen is None:
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen).to(torch.bfloat16)
        tensors[f"model.layers.{i}.self_attn.attn"] = t.to(device)
    return PagedKVCache(tensors, model="device-check", block_size=BLOCK)


def settings() -> KVTransferSettings:
    return KVTransferSettings(secret=SECRET, pull_timeout_seconds=120, port_range=(0, 0))


def producer_main(conn, device: str, layers: int, num_blocks: int, ids: list[int]) -> None:
    torch.accelerator.set_device_index(torch.device(device).index)
    cache = make_cache(device, layers, num_blocks, seed=1)
    producer = KVProducer(cache, "check-prefill", max_chunk_bytes=4 << 20)
    producer.leases.add("check", ids, time.monotonic() + 3600)
    server = serve_backends(["collective"], settings(), producer, "127.0.0.1", 0, device)
    conn.send(server.address)
    conn.recv()
    server.stop(0)


def device_copy_seconds(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.accelerator.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    torch.accelerator.synchronize()
    return time.perf_counter() - start


def pair_check(tokens: int, layers: int) -> dict:
    kind = torch.accelerator.current_accelerator().type
    count = torch.accelerator.device_count()
    if count < 2:
        return {"skipped": f"{count} {kind} device(s): a pair needs two"}
    num_blocks = -(-tokens // BLOCK) + 8
    n = -(-tokens // BLOCK)
    src_ids = torch.randperm(num_blocks)[:n].tolist()
    dst_ids = torch.randperm(num_blocks)[:n].tolist()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=producer_main, args=(child, f"{kind}:0", layers, num_blocks, src_ids))
    proc.start()
    try:
        address = parent.recv()
        device = f"{kind}:1"
        torch.accelerator.set_device_index(1)
        local = make_cache(device, layers, num_blocks, seed=None)
        client = create_transport("collective", settings(), device).connect(address)
        client.handshake(local.layout, "check-decode")
        times = []
        for _ in range(3):
            scatterer = BlockScatterer(local, 4 << 20)
            scatterer.begin(dst_ids)
            start = time.perf_counter()
            nbytes = client.pull("check", src_ids, CacheSink(scatterer), engine_id="check-decode", timeout_s=120)
            event = scatterer.finish()
            if event is not None:
                event.synchronize()
            times.append(time.perf_counter() - start)
        client.close()
    finally:
        parent.send("stop")
        proc.join(60)
    expected = make_cache("cpu", layers, num_blocks, seed=1)
    intact = all(torch.equal(dst[dst_ids].cpu(), src[src_ids]) for src, dst in zip(expected.tensors, local.tensors))
    best = min(times[1:] or times)
    copy_s = device_copy_seconds(device, nbytes)
    return {
        "backend": {"cuda": "nccl", "npu": "hccl"}.get(kind, kind),
        "bytes": nbytes,
        "intact": intact,
        "pull_GBps": nbytes / best / 1e9,
        "device_copy_GBps": nbytes / copy_s / 1e9,
        "ratio_to_device_copy": copy_s / best,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--skip-staging", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report: dict = {}
    if not torch.accelerator.is_available():
        report["skipped"] = "no accelerator: nothing to check on this host"
    else:
        if not args.skip_staging:
            import kv_staging_device_check

            report["staging_exit_code"] = kv_staging_device_check.main(
                ["--tokens", str(args.tokens), "--layers", str(args.layers)]
            )
        report["pair"] = pair_check(args.tokens, args.layers)
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        args.json.write_text(text + "\n")
    pair = report.get("pair", {})
    return 1 if pair.get("intact") is False or report.get("staging_exit_code") else 0


if __name__ == "__main__":
    sys.exit(main())
