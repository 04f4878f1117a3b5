"""The consumer's half of the shm backend's direct variant: copying layers of the leased blocks
straight out of the producer's cache into ours (cma.py), as the producer's notice describes it
(its pid, its layers' addresses, and from which layer on it pushes the rest itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.transports import cma
from pdcluster.kv_transfer.transports.base import CacheSink
from pdcluster.protos import kv_transfer_pb2 as pb


class DirectRefused(Exception):
    """The OS (or the producer) refuses direct copies with this peer: use the ring."""


class DirectRead:
    """Consumer side of a direct pull: read layers [a, b) from the producer's cache into ours."""

    def __init__(
        self, note: pb.ShmChunk, layout, block_ids: Sequence[int], sink: CacheSink, rows: list[tuple[int, int]]
    ):
        self.row_bytes = [spec.block_bytes for spec in layout.layers]
        if len(note.layer_addresses) != len(rows) or [r for _, r in rows] != self.row_bytes:
            raise KVTransferError(
                f"direct shm notice names {len(note.layer_addresses)} layers, this cache has {len(rows)}"
            )
        if not 0 <= note.push_from_layer <= len(rows):
            raise KVTransferError(f"direct shm notice pushes from layer {note.push_from_layer}")
        self.note, self.block_ids, self.sink, self.rows = note, block_ids, sink, rows

    def copy(self, start: int, stop: int) -> None:
        """Copy layers [start, stop) of our blocks out of the producer's cache."""
        if start >= stop:
            return
        remote = cma.block_iovecs(self.note.layer_addresses[start:stop], self.row_bytes[start:stop], self.block_ids)
        local = cma.block_iovecs([a for a, _ in self.rows[start:stop]], self.row_bytes[start:stop], self.sink.block_ids)
        try:
            cma.copy(self.note.pid, local, remote)
        except OSError as exc:
            if exc.errno in cma.REFUSED:
                raise DirectRefused(str(exc)) from exc
            raise KVTransferError(f"direct read from pid {self.note.pid}: {exc}") from exc

    def landed(self, start: int, stop: int) -> None:
        count = len(self.block_ids)
        for index in range(start, stop):
            self.sink.landed(Chunk(index, 0, count, count * self.row_bytes[index]))

    def read(self, start: int, stop: int) -> None:
        self.copy(start, stop)
        self.landed(start, stop)

    def finish(self, pushed_layers: int) -> int:
        """After the producer pushed `pushed_layers` from push_from_layer: read what is left."""
        start = self.note.push_from_layer
        pushed = min(pushed_layers, len(self.rows) - start)
        self.landed(start, start + pushed)
        self.read(start + pushed, len(self.rows))
        return len(self.block_ids) * sum(self.row_bytes)
