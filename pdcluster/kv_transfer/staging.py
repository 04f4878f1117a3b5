"""Event-synced, non-blocking staging between a device KV cache and reusable host buffers.

Producer (prefill): `BlockGatherer.chunks()` gathers a request's blocks, chunk by chunk, into
reusable (pinned) host slots. On an accelerator each chunk is an `index_select` plus a
`non_blocking` device-to-host copy on a side stream that first waits on the event recorded after
the forward pass which wrote the blocks; one event per slot is recorded and the sender waits on
that event only, with the next chunk already in flight (double buffering). No `.item()`,
`.tolist()`, `.cpu()` or device-wide synchronize.

Consumer (decode): `BlockScatterer.write()` copies received bytes into a host slot, issues a
`non_blocking` host-to-device copy and `index_copy_` into the cache on a side stream, and records
one event per slot; `finish()` returns the event the compute stream must wait on before attention
reads the blocks.

The device API is torch's generic one (`torch.accelerator`, `torch.Stream`, `torch.Event`), so
CUDA and Ascend (torch_npu registers the NPU as the accelerator) share this code. On CPU the same
calls degrade to plain synchronous copies straight into/out of the host buffer.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, TypeVar

import numpy as np
import torch

from pdcluster.kv_transfer.kv_cache import Chunk, PagedKVCache

T = TypeVar("T")


class Pool(Generic[T]):
    """Reuse expensive objects (pinned buffers) across concurrent transfers, one user at a time."""

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._free: list[T] = []
        self._lock = threading.Lock()

    @contextmanager
    def get(self) -> Iterator[T]:
        with self._lock:
            item = self._free.pop() if self._free else None
        if item is None:
            item = self._factory()
        try:
            yield item
        finally:
            with self._lock:
                self._free.append(item)


def contiguous_run(block_ids: Sequence[int]) -> int | None:
    """First id if block_ids is one ascending run (a, a+1, ...), else None."""
    if not block_ids:
        return None
    first = block_ids[0]
    if block_ids[-1] - first + 1 != len(block_ids):
        return None
    if all(b == first + i for i, b in enumerate(block_ids)):
        return first
    return None


def byte_rows(layer: torch.Tensor) -> np.ndarray | None:
    """A CPU layer as writable uint8 rows, one per block (None unless plain contiguous)."""
    if layer.device.type != "cpu" or not layer.is_contiguous():
        return None
    return layer.view(torch.uint8).view(layer.shape[0], -1).numpy()


def tensor_over(buffer: memoryview) -> torch.Tensor:
    """A uint8 tensor sharing a writable buffer's memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def readonly_tensor(payload: memoryview | bytes, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor over received bytes (only ever read, so the read-only warning is moot)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype)


def gather_blocks(
    layer: torch.Tensor, chunk: Chunk, block_ids: Sequence[int], index: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Copy a chunk's blocks of `layer` into `out` (uint8, chunk.nbytes, on the layer's device),
    on the current stream. `index`: all block ids as a tensor on that device (None: made here)."""
    shape = (chunk.count, *layer.shape[1:])
    dest = out[: chunk.nbytes].view(layer.dtype).view(shape)
    sub = block_ids[chunk.first : chunk.first + chunk.count]
    run = contiguous_run(sub)
    if run is not None:
        dest.copy_(layer[run : run + chunk.count])
    elif index is not None:
        torch.index_select(layer, 0, index[chunk.first : chunk.first + chunk.count], out=dest)
    else:
        torch.index_select(layer, 0, torch.tensor(sub, dtype=torch.int64), out=dest)


class DeviceContext:
    """The KV cache's device, with a side stream and event factory when it is an accelerator."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_accelerator = device.type != "cpu"
        self.stream = torch.Stream(device=device) if self.is_accelerator else None

    def event(self) -> torch.Event | None:
        return torch.Event(device=self.device) if self.is_accelerator else None

    def record_compute_event(self) -> torch.Event | None:
        """An event on the current (compute) stream: everything enqueued so far."""
        if not self.is_accelerator:
            return None
        event = torch.Event(device=self.device)
        event.record(torch.accelerator.current_stream(self.device))
        return event

    def compute_stream_wait(self, event: torch.Event | None) -> None:
        """Make the compute stream wait (on the device, not the host) for `event`."""
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_accelerator)

    def index_tensor(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an index tensor on the cache's device (non-blocking from pinned memory)."""
        host = torch.tensor(ids, dtype=torch.int64)
        if not self.is_accelerator:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


class _Slot:
    """A reusable host buffer plus the event that says its last copy finished."""

    def __init__(self, ctx: DeviceContext, nbytes: int):
        self.host = ctx.host_buffer(nbytes)
        self.device_tmp = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device) if ctx.is_accelerator else None
        self.event = ctx.event()
        self.busy = False

    def wait(self) -> None:
        if self.busy and self.event is not None:
            self.event.synchronize()  # waits for this slot's copy only
        self.busy = False


class BlockGatherer:
    """Producer side: stream a request's blocks out of the cache into reusable host slots."""

    def __init__(self, cache: PagedKVCache, max_chunk_bytes: int, num_slots: int = 2):
        self.cache = cache
        self.ctx = DeviceContext(cache.device)
        self.max_chunk_bytes = max_chunk_bytes
        nbytes = cache.max_chunk_nbytes(max_chunk_bytes)
        self.slots = [_Slot(self.ctx, nbytes) for _ in range(max(1, num_slots))]

    def _gather(
        self,
        slot: _Slot,
        chunk: Chunk,
        ids: Sequence[int],
        ids_dev: torch.Tensor | None,
        target: memoryview | None = None,
    ) -> None:
        layer = self.cache.tensors[chunk.layer_index]
        if not self.ctx.is_accelerator:
            dest = slot.host if target is None else tensor_over(target)
            gather_blocks(layer, chunk, ids, None, dest)
            return
        assert slot.device_tmp is not None and ids_dev is not None
        with self.ctx.stream:
            gather_blocks(layer, chunk, ids, ids_dev, slot.device_tmp)
            slot.host[: chunk.nbytes].copy_(slot.device_tmp[: chunk.nbytes], non_blocking=True)
            slot.event.record(self.ctx.stream)
        slot.busy = True

    def chunks(
        self,
        block_ids: Sequence[int],
        ready_event: torch.Event | None = None,
        max_chunk_bytes: int | None = None,
        into: Callable[[Chunk], memoryview] | None = None,
        keep_previous: bool = False,
    ) -> Iterator[tuple[Chunk, memoryview]]:
        """Yield (chunk, bytes) in plan order. Each memoryview is valid until the generator is
        resumed after its yield; with `keep_previous` (and two slots or more) until it is resumed
        after the next one, so the caller may gather the next chunk while the last one's bytes
        are still being read out of its slot (one chunk fewer in flight on an accelerator).

        With `into`, each chunk is written into the buffer `into(chunk)` returns (exactly
        chunk.nbytes long) and that buffer is yielded: on CPU the blocks are gathered straight
        into it; on an accelerator it receives the pinned slot once the slot's event completed.
        """
        plan = self.cache.chunk_plan(len(block_ids), max_chunk_bytes or self.max_chunk_bytes)
        if not plan:
            return
        n = len(self.slots)
        if keep_previous and n < 2:
            raise ValueError("keep_previous needs a gatherer with two slots or more")
        if not self.ctx.is_accelerator:
            # A synchronous gather, just before its chunk is handed out: into the next slot
            # when the previous chunk must stay readable, else always into the first.
            for i, chunk in enumerate(plan):
                slot = self.slots[i % n if keep_previous else 0]
                target = into(chunk) if into is not None else None
                self._gather(slot, chunk, block_ids, None, target)
                yield chunk, target if target is not None else memoryview(slot.host[: chunk.nbytes].numpy())
            return
        with self.ctx.stream:
            if ready_event is not None:
                self.ctx.stream.wait_event(ready_event)  # blocks written by the forward pass
            ids_dev = self.ctx.index_tensor(block_ids)
        # Up to `depth` chunks in flight; hand out the oldest once its own event completes. A
        # slot is refilled only when the chunk it held may no longer be read.
        depth = n - 1 if keep_previous else n
        gathered = 0
        for i, chunk in enumerate(plan):
            while gathered < min(len(plan), i + depth):
                self._gather(self.slots[gathered % n], plan[gathered], block_ids, ids_dev)
                gathered += 1
            slot = self.slots[i % n]
            slot.wait()
            data = memoryview(slot.host[: chunk.nbytes].numpy())
            if into is not None:
                target = into(chunk)
                target[:] = data
                data = target
            yield chunk, data


class BlockScatterer:
    """Consumer side: write received chunks into the request's local blocks."""

    def __init__(self, cache: PagedKVCache, max_chunk_bytes: int, num_slots: int = 2):
        self.cache = cache
        self.ctx = DeviceContext(cache.device)
        nbytes = cache.max_chunk_nbytes(max_chunk_bytes)
        self.slots = [_Slot(self.ctx, nbytes) for _ in range(max(1, num_slots))] if self.ctx.is_accelerator else []
        # CPU: each contiguous layer as a numpy [num_blocks, block_bytes] view for fast scatter.
        self._rows = [byte_rows(t) if not self.ctx.is_accelerator else None for t in cache.tensors]
        self._next = 0
        self._ids_dev: torch.Tensor | None = None
        self._ids: Sequence[int] = ()

    def begin(self, local_block_ids: Sequence[int]) -> None:
        self.cache.check_block_ids(local_block_ids)
        self._ids = local_block_ids
        if self.ctx.is_accelerator:
            with self.ctx.stream:
                self._ids_dev = self.ctx.index_tensor(local_block_ids)

    @property
    def block_ids(self) -> Sequence[int]:
        return self._ids

    def host_rows(self) -> list[tuple[int, int]] | None:
        """Per layer (address, bytes per block) when every layer is a plain host array of block
        rows (what a direct cross-process read can fill), else None."""
        if self.ctx.is_accelerator or any(rows is None for rows in self._rows):
            return None
        return [(t.data_ptr(), b) for t, b in zip(self.cache.tensors, self.cache.block_bytes)]

    def write(self, chunk: Chunk, payload: memoryview | bytes | torch.Tensor) -> None:
        if isinstance(payload, torch.Tensor) and payload.device.type != "cpu":
            self._write_device(chunk, payload)
            return
        layer = self.cache.tensors[chunk.layer_index]
        shape = (chunk.count, *layer.shape[1:])
        sub = self._ids[chunk.first : chunk.first + chunk.count]
        run = contiguous_run(sub)
        if not self.ctx.is_accelerator:
            rows = self._rows[chunk.layer_index]
            if rows is not None:
                # numpy's row assignment is a memcpy per block, faster on CPU than torch's
                # index_copy_ for this shape.
                src = np.frombuffer(payload, dtype=np.uint8).reshape(chunk.count, -1)
                if run is not None:
                    rows[run : run + chunk.count] = src
                else:
                    rows[np.asarray(sub, dtype=np.int64)] = src
                return
            src = readonly_tensor(payload, layer.dtype).view(shape)
            if run is not None:
                layer[run : run + chunk.count].copy_(src)
            else:
                layer.index_copy_(0, torch.tensor(sub, dtype=torch.int64), src)
            return
        slot = self.slots[self._next % len(self.slots)]
        self._next += 1
        slot.wait()  # the slot's previous host-to-device copy has finished
        slot.host[: chunk.nbytes].copy_(readonly_tensor(payload, torch.uint8))
        assert slot.device_tmp is not None and self._ids_dev is not None
        with self.ctx.stream:
            slot.device_tmp[: chunk.nbytes].copy_(slot.host[: chunk.nbytes], non_blocking=True)
            src = slot.device_tmp[: chunk.nbytes].view(layer.dtype).view(shape)
            if run is not None:
                layer[run : run + chunk.count].copy_(src)
            else:
                layer.index_copy_(0, self._ids_dev[chunk.first : chunk.first + chunk.count], src)
            slot.event.record(self.ctx.stream)
        slot.busy = True

    def _write_device(self, chunk: Chunk, src: torch.Tensor) -> None:
        """A chunk already on the cache's device (collective backend): scatter it on the side
        stream after what the caller's stream enqueued (the recv); the caller's stream then waits
        for the scatter before it may reuse `src`."""
        assert self._ids_dev is not None
        layer = self.cache.tensors[chunk.layer_index]
        shape = (chunk.count, *layer.shape[1:])
        sub = self._ids[chunk.first : chunk.first + chunk.count]
        run = contiguous_run(sub)
        caller = torch.accelerator.current_stream(self.ctx.device)
        self.ctx.stream.wait_stream(caller)
        with self.ctx.stream:
            data = src[: chunk.nbytes].view(layer.dtype).view(shape)
            if run is not None:
                layer[run : run + chunk.count].copy_(data)
            else:
                layer.index_copy_(0, self._ids_dev[chunk.first : chunk.first + chunk.count], data)
        caller.wait_stream(self.ctx.stream)

    def finish(self) -> torch.Event | None:
        """Event after every enqueued write; the compute stream must wait on it (None on CPU)."""
        if not self.ctx.is_accelerator:
            return None
        event = self.ctx.event()
        event.record(self.ctx.stream)
        return event
