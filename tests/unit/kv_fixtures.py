"""Synthetic paged KV caches shaped like vLLM's CPU backend ([blocks, kv_heads, block, 2*head])."""

from __future__ import annotations

import torch

from pdcluster.kv_transfer.kv_cache import PagedKVCache


def make_cache(
    *,
    num_blocks: int = 64,
    layers: int = 3,
    kv_heads: int = 2,
    block_size: int = 16,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    fill: str = "random",
    model: str = "tiny",
    seed: int = 0,
    strided: bool = False,
) -> PagedKVCache:
    """`strided`: each layer heads-major in memory, a view with blocks on dim 0 whose block rows
    are not contiguous (as attention backends with an HND layout hand them over); same values."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
        if fill == "random":
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
        if strided:
            t = t.transpose(0, 1).contiguous().transpose(0, 1)
        tensors[f"model.layers.{i}.self_attn.attn"] = t
    return PagedKVCache(tensors, model=model, block_size=block_size)


def make_worker(settings, engine_id: str, *, producer: bool, fill: str = "random"):
    """A connector worker half (tp 1) over a make_cache cache: a producer or a consumer."""
    from pdcluster.kv_transfer.worker import ConnectorWorker

    cache = make_cache(fill=fill)
    worker = ConnectorWorker(
        settings,
        engine_id,
        model="tiny",
        block_size=16,
        num_blocks=None,
        tp_size=1,
        tp_rank=0,
        is_producer=producer,
        is_consumer=not producer,
    )
    worker.register_kv_caches(dict(zip(cache.layer_names, cache.tensors)))
    return worker
