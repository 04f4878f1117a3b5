"""Exercise the KV staging device path on an accelerator host (CUDA or Ascend via torch_npu).

What it checks, on the current torch accelerator (falls back to CPU, where it only checks
correctness of the degraded path):
1. correctness: blocks gathered from one paged cache (after an event-synced "forward" that wrote
   them) and scattered into another arrive intact, in order, into scattered block ids;
2. no hidden synchronisation: on CUDA the gather/scatter hot path runs under
   torch.cuda.set_sync_debug_mode("error"), which raises on .item()/.tolist()/.cpu()/
   device-wide syncs (waiting on one event is allowed: that is the design);
3. timing against a blocking copy (index + .cpu() per layer, then .to(device)), and overlap: the
   same transfer while the compute stream runs matmuls.

Usage: python tools/kv_staging_device_check.py [--tokens 8192] [--layers 28] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcluster.kv_transfer.kv_cache import PagedKVCache  # noqa: E402
from pdcluster.kv_transfer.staging import BlockGatherer, BlockScatterer, DeviceContext  # noqa: E402


def make_cache(device, layers, num_blocks, block_size, kv_heads, head_dim, fill) -> PagedKVCache:
    tensors = {}
    for i in range(layers):
        t = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_dim, dtype=torch.bfloat16, device=device)
        tensors[f"model.layers.{i}.self_attn.attn"] = t
    return PagedKVCache(tensors, model="check", block_size=block_size)


def synchronize(device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)  # outside the timed hot path only


def transfer(src: PagedKVCache, dst: PagedKVCache, src_ids, dst_ids, ready_event, chunk_bytes):
    gatherer = BlockGatherer(src, chunk_bytes)
    scatterer = BlockScatterer(dst, chunk_bytes)
    scatterer.begin(dst_ids)
    for chunk, data in gatherer.chunks(src_ids, ready_event):
        scatterer.write(chunk, data)
    return scatterer.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    ctx = DeviceContext(device)
    n = -(-args.tokens // args.block_size)
    num_blocks = 2 * n + 16
    src = make_cache(device, args.layers, num_blocks, args.block_size, 4, 128, True)
    dst = make_cache(device, args.layers, num_blocks, args.block_size, 4, 128, False)
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()

    # "Forward pass": the compute stream writes the blocks, then records the ready event.
    for layer in src.tensors:
        layer.normal_()
    ready = ctx.record_compute_event()

    report = {"device": str(device), "tokens": args.tokens, "layers": args.layers}
    sync_mode = None
    if device.type == "cuda":
        sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        done = transfer(src, dst, src_ids, dst_ids, ready, args.chunk_bytes)
        ctx.compute_stream_wait(done)
        host_return_s = time.perf_counter() - t0
    finally:
        if sync_mode is not None:
            torch.cuda.set_sync_debug_mode(sync_mode)
    synchronize(device)
    staged_s = time.perf_counter() - t0
    ok = all(torch.equal(d[dst_ids], s[src_ids]) for s, d in zip(src.tensors, dst.tensors))
    nbytes = n * src.layout.bytes_per_block()
    report.update(
        correct=ok,
        bytes=nbytes,
        staged_GBps=nbytes / staged_s / 1e9,
        host_return_s=host_return_s,
        no_hidden_sync=device.type == "cuda",
    )

    # Blocking reference: index + .cpu() per layer, then back to the device.
    synchronize(device)
    t0 = time.perf_counter()
    index_src = torch.tensor(src_ids, device=device)
    index_dst = torch.tensor(dst_ids, device=device)
    for s, d in zip(src.tensors, dst.tensors):
        host = s.index_select(0, index_src).cpu()
        d.index_copy_(0, index_dst, host.to(device))
    synchronize(device)
    blocking_s = time.perf_counter() - t0
    report.update(blocking_GBps=nbytes / blocking_s / 1e9, speedup_vs_blocking=blocking_s / staged_s)

    if device.type != "cpu":
        # Overlap: the transfer while the compute stream is busy with matmuls.
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        synchronize(device)
        compute_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        ready = ctx.record_compute_event()
        done = transfer(src, dst, src_ids, dst_ids, ready, args.chunk_bytes)
        ctx.compute_stream_wait(done)
        synchronize(device)
        both_s = time.perf_counter() - t0
        report.update(compute_s=compute_s, compute_plus_transfer_s=both_s, transfer_alone_s=staged_s)

    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
