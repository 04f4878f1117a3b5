"""The engine's paged KV cache as the transfer code sees it: named layers, blocks on dim 0.

vLLM 0.32 hands every KV connector one tensor per attention layer (draft/MTP layers included)
whose logical dim 0 is the block index (its KV layout RFC: [L, B, H, N, C] with K and V packed in
C; physical strides may differ by backend). A request's blocks are therefore rows of dim 0 in
every layer, which is all the gather/scatter code relies on. `chunk_plan` cuts a request's blocks
into per-layer chunks of bounded size, the unit that travels on the wire.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import re
from dataclasses import dataclass

import torch

from pdcluster.errors import HandshakeError
from pdcluster.kv_transfer.protocol import KVLayout, LayerSpec

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # linux/mman.h
_HUGE_PAGE = 2 << 20


def natural_key(name: str) -> list:
    """'model.layers.10.attn' sorts after 'model.layers.2.attn'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Chunk:
    """`count` consecutive entries, from `first`, of a request's block list, in one layer."""

    layer_index: int
    first: int
    count: int
    nbytes: int


def chunk_plan(block_bytes: list[int], num_blocks: int, max_chunk_bytes: int) -> list[Chunk]:
    """Per layer, in layer order, consecutive runs of at most max_chunk_bytes (≥ 1 block).

    Both peers can compute it from the agreed layout (the collective backend does)."""
    plan = []
    for layer_index, nbytes in enumerate(block_bytes):
        per_chunk = max(1, max_chunk_bytes // nbytes)
        for first in range(0, num_blocks, per_chunk):
            count = min(per_chunk, num_blocks - first)
            plan.append(Chunk(layer_index, first, count, count * nbytes))
    return plan


class PagedKVCache:
    """Ordered, validated view over the per-layer KV tensors registered by vLLM."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        *,
        model: str,
        block_size: int,
        num_blocks: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        names, tensors, seen = [], [], set()
        for name in sorted(kv_caches, key=natural_key):
            tensor = kv_caches[name]
            # Layers that share one cache tensor (KV sharing) move once, under the first name.
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            names.append(name)
            tensors.append(tensor)
        blocks = {t.shape[0] for t in tensors}
        if len(blocks) != 1:
            raise ValueError(f"KV layers disagree on the number of blocks: {sorted(blocks)}")
        self.num_blocks = blocks.pop()
        if num_blocks is not None and num_blocks != self.num_blocks:
            raise ValueError(
                f"KV cache dim 0 is {self.num_blocks}, expected num_blocks={num_blocks}: "
                "this attention backend does not put blocks on dim 0"
            )
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV layers live on several devices: {devices}")
        self.device: torch.device = devices.pop()
        self.layer_names: list[str] = names
        self.tensors: list[torch.Tensor] = tensors
        self.layout = KVLayout(
            model=model,
            block_size=block_size,
            layers=tuple(
                LayerSpec(name=n, block_shape=tuple(t.shape[1:]), dtype=dtype_name(t.dtype))
                for n, t in zip(names, tensors)
            ),
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        self.block_bytes = [spec.block_bytes for spec in self.layout.layers]

    def back_with_huge_pages(self) -> int:
        """CPU caches: move the cache's memory onto 2 MiB pages (see `huge_pages`)."""
        if self.device.type != "cpu":
            return 0
        return huge_pages(self.tensors)

    def check_block_ids(self, block_ids: list[int] | tuple[int, ...]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise HandshakeError(f"block ids {bad[:4]} outside this cache (num_blocks={self.num_blocks})")

    def chunk_plan(self, num_blocks: int, max_chunk_bytes: int) -> list[Chunk]:
        return chunk_plan(self.block_bytes, num_blocks, max_chunk_bytes)

    def max_chunk_nbytes(self, max_chunk_bytes: int) -> int:
        return max(max(1, max_chunk_bytes // b) * b for b in self.block_bytes)


def _merged_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The address ranges the tensors' storages cover, overlapping ones merged."""
    spans = sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()) for t in tensors
    )
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def huge_pages(tensors: list[torch.Tensor]) -> int:
    """Move CPU tensors' memory onto 2 MiB pages; returns the bytes collapsed.

    vLLM's CPU cache is ordinary anonymous memory on 4 KiB pages (THP is opt-in, `madvise`, on
    most distributions). Every cross-process copy pins the pages it touches (process_vm_readv/
    writev in the shm backend), and attention walks the blocks: on 2 MiB pages both touch 512x
    fewer page-table entries. MADV_COLLAPSE (Linux 6.1+) rebuilds the already-populated range on
    huge pages in place, contents kept; where it is refused, the MADV_HUGEPAGE hint still lets the
    kernel collapse the range in the background.
    """
    if platform.system() != "Linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed, refused = 0, None
    for start, end in _merged_ranges(tensors):
        first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
        if last <= first:
            continue
        if libc.madvise(first, last - first, _MADV_HUGEPAGE) != 0:
            refused = ctypes.get_errno()
        elif libc.madvise(first, last - first, _MADV_COLLAPSE) == 0:
            collapsed += last - first
        else:
            refused = ctypes.get_errno()
    if refused is not None:
        logger.info("huge pages refused (errno %d); %d bytes collapsed", refused, collapsed)
    return collapsed
