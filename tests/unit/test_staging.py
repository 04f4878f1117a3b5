"""Staging on CPU: gather/scatter move exactly the requested blocks, chunked as planned."""

import logging

import pytest
import torch

from pdcluster.kv_transfer.kv_cache import PagedKVCache, _merged_ranges
from pdcluster.kv_transfer.staging import BlockGatherer, BlockScatterer, contiguous_run
from tests.support.hugepages import hinted_kib, thp_available
from tests.unit.kv_fixtures import make_cache


def roundtrip(src_ids, dst_ids, max_chunk_bytes):
    src = make_cache()
    dst = make_cache(fill="zeros")
    gatherer = BlockGatherer(src, max_chunk_bytes)
    scatterer = BlockScatterer(dst, max_chunk_bytes)
    scatterer.begin(dst_ids)
    chunks = 0
    for chunk, data in gatherer.chunks(src_ids):
        scatterer.write(chunk, bytes(data))
        chunks += 1
    assert scatterer.finish() is None  # CPU: nothing for the compute stream to wait on
    return src, dst, chunks


def test_scattered_blocks_arrive_in_order():
    src_ids, dst_ids = [5, 2, 40, 41, 7], [0, 9, 3, 63, 12]
    src, dst, _ = roundtrip(src_ids, dst_ids, 4 << 20)
    for layer_src, layer_dst in zip(src.tensors, dst.tensors):
        assert torch.equal(layer_dst[dst_ids], layer_src[src_ids])
        untouched = [b for b in range(64) if b not in dst_ids]
        assert not layer_dst[untouched].any()


def test_contiguous_runs_use_the_same_semantics():
    src, dst, _ = roundtrip(list(range(10, 20)), list(range(30, 40)), 4 << 20)
    for layer_src, layer_dst in zip(src.tensors, dst.tensors):
        assert torch.equal(layer_dst[30:40], layer_src[10:20])


def test_chunking_bounds_each_message():
    cache = make_cache()
    block_bytes = cache.block_bytes[0]  # 2*16*16*2 = 1024
    plan = cache.chunk_plan(10, 3 * block_bytes)
    assert [c.count for c in plan if c.layer_index == 0] == [3, 3, 3, 1]
    assert all(c.nbytes <= 3 * block_bytes for c in plan)
    _, _, chunks = roundtrip(list(range(10)), list(range(20, 30)), 3 * block_bytes)
    assert chunks == len(plan)


def test_keep_previous_leaves_the_last_chunk_readable_while_the_next_is_gathered():
    """What the Mooncake producer relies on to gather chunk i+1 while a consumer reads chunk i."""
    cache = make_cache()
    ids = [5, 2, 40, 41, 7, 9]
    block_bytes = cache.block_bytes[0]
    chunks = BlockGatherer(cache, 2 * block_bytes).chunks(ids, max_chunk_bytes=2 * block_bytes, keep_previous=True)
    previous = None
    count = 0
    for chunk, data in chunks:
        if previous is not None:  # the chunk before this one, its view taken before this gather
            last, view = previous
            expected = cache.tensors[last.layer_index][ids[last.first : last.first + last.count]]
            assert bytes(view) == expected.view(torch.uint8).numpy().tobytes()
        previous = chunk, data
        count += 1
    assert count == len(cache.chunk_plan(len(ids), 2 * block_bytes)) > 2


def test_keep_previous_needs_two_slots():
    cache = make_cache()
    with pytest.raises(ValueError, match="two slots"):
        next(BlockGatherer(cache, 4 << 20, num_slots=1).chunks([1, 2], keep_previous=True))


def test_chunk_smaller_than_a_block_still_moves_one_block():
    cache = make_cache()
    plan = cache.chunk_plan(2, 1)
    assert [c.count for c in plan] == [1] * 6


def test_contiguous_run_detection():
    assert contiguous_run([4, 5, 6]) == 4
    assert contiguous_run([4, 6, 5]) is None
    assert contiguous_run([4, 5, 7]) is None
    assert contiguous_run([]) is None


def test_huge_pages_keep_the_cache_contents(caplog):
    """The connector moves a CPU cache onto 2 MiB pages in place (MADV_COLLAPSE): same bytes. The
    range is hinted (MADV_HUGEPAGE); the collapse is the kernel's to grant (no free 2 MiB blocks:
    ENOMEM / EAGAIN; before Linux 6.1: EINVAL), and a refusal is logged with its errno."""
    caplog.set_level(logging.INFO, logger="pdcluster.kv_transfer.kv_cache")
    tensors = {f"model.layers.{i}.attn": torch.empty(256, 4, 16, 256, dtype=torch.bfloat16) for i in range(2)}
    for t in tensors.values():
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
    before = [t.clone() for t in tensors.values()]
    cache = PagedKVCache(tensors, model="m", block_size=16)
    collapsed = cache.back_with_huge_pages()
    assert collapsed % (2 << 20) == 0 and collapsed <= sum(t.nbytes for t in tensors.values())
    if thp_available():
        ranges = _merged_ranges(list(tensors.values()))  # each loses < 4 MiB to 2 MiB alignment
        hinted = sum(hinted_kib(within=r)[0] for r in ranges)
        assert hinted << 10 >= sum(t.nbytes for t in tensors.values()) - len(ranges) * (4 << 20)
        assert collapsed >= 2 << 20 or "huge pages refused (errno" in caplog.text
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, tensors.values()))


def test_merged_ranges_join_views_of_one_buffer():
    buffer = torch.zeros(4 << 20, dtype=torch.uint8)
    views = [buffer[: 2 << 20], buffer[1 << 20 :]]
    assert _merged_ranges(views) == [(buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes)]
