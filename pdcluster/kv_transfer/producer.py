"""What a transport server serves: a prefill engine's leased KV blocks.

`KVProducer` lives in the prefill engine's model-runner process, beside its KV cache. Transport servers
(gRPC today) call `handshake`, `stream` and `release`; the connector worker registers leases from
the scheduler's metadata and collects released or expired ones every step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from pdcluster.errors import HandshakeError
from pdcluster.kv_transfer.faults import FaultInjector
from pdcluster.kv_transfer.kv_cache import Chunk, PagedKVCache
from pdcluster.kv_transfer.leases import Lease, LeaseTable
from pdcluster.kv_transfer.protocol import (
    KVLayout,
    check_protocol_version,
    compare_layouts,
    layout_digest,
)
from pdcluster.kv_transfer.staging import BlockGatherer, Pool

logger = logging.getLogger(__name__)

# The longest a lease lookup is held while none of its keys is in. A consumer cancels its lookup
# as soon as it has another key to ask for, and a held lookup wakes the moment a lease it asks
# for is filed, so the hold bounds only how often an idle consumer asks (lookups held at once are
# bounded by the server: grpc_transport).
HANDOUT_WAIT_CAP_S = 1.0


class KVProducer:
    def __init__(
        self,
        cache: PagedKVCache,
        engine_id: str,
        *,
        max_chunk_bytes: int,
        lease_wait_s: float = 10.0,
        lease_seconds: float = 30.0,
        faults: FaultInjector | None = None,
        on_lease_end: Callable[[], None] | None = None,
    ):
        self.cache = cache
        self.engine_id = engine_id
        self.layout: KVLayout = cache.layout
        self.digest = layout_digest(cache.layout)
        self.leases = LeaseTable(on_lease_end)
        self.max_chunk_bytes = max_chunk_bytes
        self.lease_wait_s = lease_wait_s
        self.lease_seconds = lease_seconds  # what a renewal extends a lease to
        self.faults = faults or FaultInjector()
        self._gatherers: Pool[BlockGatherer] = Pool(lambda: BlockGatherer(cache, max_chunk_bytes))
        self.bytes_sent = 0
        self.pulls_served = 0
        self._sent_lock = threading.Lock()  # pulls are served from several threads at once

    def handshake(self, remote_version: int, remote_layout: KVLayout) -> None:
        """Raise HandshakeError (naming both sides) unless the consumer can read our blocks."""
        check_protocol_version(remote_version, remote_role="decode (consumer)")
        compare_layouts(self.layout, remote_layout, local_role="prefill (producer)", remote_role="decode (consumer)")

    def stream(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        remote_version: int,
        remote_digest: int,
        max_chunk_bytes: int = 0,
        into: Callable[[Chunk], memoryview] | None = None,
    ) -> Iterator[tuple[Chunk, memoryview]]:
        """Yield the leased blocks chunk by chunk; the lease cannot be freed while this runs.

        `into` lets the transport supply each chunk's destination (see BlockGatherer.chunks).
        """
        with self.leased(request_id, block_ids, remote_version, remote_digest) as lease:
            with self._gatherers.get() as gatherer:
                chunk_bytes = self.chunk_bytes(max_chunk_bytes)
                for chunk, data in gatherer.chunks(block_ids, lease.ready_event, chunk_bytes, into):
                    self.count_sent(chunk.nbytes)
                    yield chunk, data

    def count_sent(self, nbytes: int) -> None:
        with self._sent_lock:  # `+=` from two threads can lose one
            self.bytes_sent += nbytes

    def chunk_bytes(self, requested: int) -> int:
        """The chunk size of a pull: the consumer's wish, capped by ours (0: ours)."""
        return min(requested or self.max_chunk_bytes, self.max_chunk_bytes)

    @contextmanager
    def leased(
        self, request_id: str, block_ids: Sequence[int], remote_version: int, remote_digest: int
    ) -> Iterator[Lease]:
        """Hold a request's lease while its blocks are read (every backend reads through this)."""
        check_protocol_version(remote_version, remote_role="decode (consumer)")
        if remote_digest != self.digest:
            raise HandshakeError(
                f"pull for {request_id} was made against KV layout digest {remote_digest:#x}, "
                f"this producer's is {self.digest:#x}: handshake again"
            )
        self.cache.check_block_ids(block_ids)
        if self.faults.should_stall_serving():
            time.sleep(self.faults.config.serve_delay_s)  # injected fault: a stalled producer
        lease = self.leases.acquire(request_id, block_ids, self.lease_wait_s)
        started = time.perf_counter()
        try:
            yield lease
        finally:
            self.leases.end_pull(lease)
            self.pulls_served += 1
            logger.debug("served %s in %.1f ms", request_id, (time.perf_counter() - started) * 1e3)

    def release(self, request_id: str, transferred: bool) -> bool:
        return self.leases.release(request_id, transferred)

    def renew(self, request_ids) -> int:
        return self.leases.renew(request_ids, self.lease_seconds)

    def handouts(
        self, keys: Sequence[str], wait_s: float, stop: threading.Event | None = None
    ) -> dict[str, tuple[str, int]]:
        """The leases filed under `keys` so far (LeaseTable.handouts), holding the call up to
        wait_s (capped at HANDOUT_WAIT_CAP_S) for one, or until `stop` is set and `end_hold`
        called (the consumer cancelled the call)."""
        return self.leases.handouts(keys, min(max(wait_s, 0.0), HANDOUT_WAIT_CAP_S), stop)

    def end_hold(self, stop: threading.Event) -> None:
        """Set `stop` and wake the lookup it belongs to (its caller went away); nothing to wake
        once that lookup has answered (it sets `stop` itself)."""
        if stop.is_set():
            return
        stop.set()
        self.leases.wake()
