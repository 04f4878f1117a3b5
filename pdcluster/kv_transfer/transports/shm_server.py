"""The producer's half of the shm backend (shm.py has the design): `ShmExtension` adds
`ShmRegister` and `ShmPull` to the producer's control server; a pull is served through a ring of
a shared-memory segment, or (direct variant) by writing into the registered consumer's cache.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Iterator

import grpc

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.staging import Pool
from pdcluster.kv_transfer.transports import cma, peers, rpc
from pdcluster.kv_transfer.transports.base import Authorize, ServerExtension
from pdcluster.kv_transfer.transports.grpc_transport import pull_errors_abort, stream_pull
from pdcluster.kv_transfer.transports.segments import SHM_DIR, SLOTS, Ring, free_bytes, remove_orphans, ring_bytes
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)


def check_ring_budget(one_ring: int, concurrent_pulls: int) -> None:
    """At start: /dev/shm must hold one ring (else a clear error now), and should hold one per
    concurrent pull (else a warning: pulls beyond what fits fail when their ring is made)."""
    free = free_bytes()
    if free < one_ring:
        raise KVTransferError(
            f"{SHM_DIR} has {free} bytes free, one shm ring needs {one_ring}: enlarge it (e.g. docker "
            "--shm-size) or use kv_transfer.backend grpc"
        )
    if free < one_ring * concurrent_pulls:
        logger.warning(
            "%s has %d bytes free: %d of %d concurrent shm pulls' rings (%d bytes each) fit",
            SHM_DIR,
            free,
            free // one_ring,
            concurrent_pulls,
            one_ring,
        )


class _ConsumerGone(Exception):
    pass


class _ConsumerSilent(_ConsumerGone):
    """The consumer's call is open but it said nothing by its own deadline (a stopped process)."""


# What the producer waits for a direct pull's consumer beyond the deadline the consumer sent:
# both count on this host's monotonic clock, from points a call's setup apart.
DIRECT_HOLD_MARGIN_S = 1.0


class _Consumed:
    """How many chunks the consumer has copied out, read from its side of the ShmPull stream."""

    def __init__(self, requests: Iterator[pb.ShmPullRequest]):
        self._requests = requests
        self.count = 0

    def wait_for(self, count: int) -> None:
        while self.count < count:
            message = next(self._requests, None)
            if message is None:
                raise _ConsumerGone
            self.count = max(self.count, message.consumed)


class _Watched(_Consumed):
    """_Consumed for a direct pull, read on a thread of its own: the producer learns that the
    consumer gave up (it half-closed its stream) before it would write into its cache."""

    def __init__(self, requests: Iterator[pb.ShmPullRequest]):
        super().__init__(requests)
        self.gone = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, name="kv-shm-direct", daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self._requests:
                with self._cond:
                    self.count = max(self.count, message.consumed)
                    self._cond.notify_all()
        except grpc.RpcError:
            pass  # the call ended (cancelled, or the consumer went away): gone, as below
        finally:
            with self._cond:
                self.gone = True
                self._cond.notify_all()

    def wait_for(self, count: int, until: float | None = None) -> None:
        """Until the consumer confirmed `count` chunks; _ConsumerGone once it left, _ConsumerSilent
        at `until` (monotonic; None: no bound) with its call still open."""
        timeout = None if until is None else max(0.0, until - time.monotonic())
        with self._cond:
            self._cond.wait_for(lambda: self.count >= count or self.gone, timeout)
            if self.count < count:
                raise _ConsumerGone if self.gone else _ConsumerSilent


class ShmExtension(ServerExtension):
    def __init__(self, producer: KVProducer, concurrent_pulls: int = 1):
        self.producer = producer
        slot_bytes = producer.cache.max_chunk_nbytes(producer.max_chunk_bytes)
        remove_orphans()  # a killed producer's rings, before the budget counts what is free
        check_ring_budget(ring_bytes(slot_bytes), concurrent_pulls)
        self._rings: list[Ring] = []
        self._lock = threading.Lock()
        self._closed = False

        def make_ring() -> Ring:
            ring = Ring(slot_bytes)
            with self._lock:
                if self._closed:
                    ring.segment.close()
                    ring.segment.unlink()
                    raise KVTransferError("KV server is stopping")
                self._rings.append(ring)
            return ring

        self._pool: Pool[Ring] = Pool(make_ring)
        cache = producer.cache
        # The direct variant needs every layer as plain host rows of blocks.
        self._addresses = (
            [t.data_ptr() for t in cache.tensors]
            if cache.device.type == "cpu" and all(t.is_contiguous() for t in cache.tensors)
            else None
        )
        self._peers = peers.PeerRegistry("shm") if self._addresses is not None and cma.available() else None
        # Direct pushes in progress, and when the last one's write window closed (monotonic):
        # what the consumer's fence waits for, as tests and diagnostics see it.
        self.pushing = 0
        self.last_push_end = 0.0
        atexit.register(self.close)

    def handlers(self, authorize: Authorize) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "ShmRegister": rpc.unary_unary(
                authorize, "ShmRegister", pb.ShmRegisterRequest, pb.ShmRegisterResponse, self._register
            ),
            "ShmPull": rpc.stream_stream(authorize, "ShmPull", pb.ShmPullRequest, pb.ShmChunk, self._serve),
        }

    def handshake_fields(self) -> dict[str, str]:
        return {"shm_socket": self._peers.name} if self._peers is not None else {}

    def _register(self, request: pb.ShmRegisterRequest, session, context) -> pb.ShmRegisterResponse:
        if self._peers is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this producer serves no direct shm pulls")
        regions = [(r.address, r.nbytes, r.row_bytes) for r in request.regions]
        try:
            registration = self._peers.register(request.token, request.pid, session.id, regions)
        except peers.PeerRefused as exc:
            self._peers.refuse(str(exc))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.ShmRegisterResponse(registration=registration)

    def _serve(self, requests: Iterator[pb.ShmPullRequest], session, context) -> Iterator[pb.ShmChunk]:
        first = next(requests, None)
        if first is None or not first.HasField("pull"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ShmPull must open with the pull")
        pull = first.pull
        if first.direct:
            began = time.monotonic()
            consumed = _Watched(requests)
            destination = self._destination(first, session, context)
            until = began + first.deadline_ms / 1000 + DIRECT_HOLD_MARGIN_S if first.deadline_ms else None
            with pull_errors_abort(context):
                try:
                    yield from self._serve_direct(first, destination, consumed, until)
                except _ConsumerSilent:
                    message = (
                        f"the consumer of the direct shm pull of {pull.request_id} said nothing within its "
                        f"{first.deadline_ms / 1000:g} s deadline; the lease is no longer held for it"
                    )
                    logger.warning("%s", message)
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
                except _ConsumerGone:
                    logger.warning(
                        "consumer left the direct shm pull of %s %.1f s after it began",
                        pull.request_id,
                        time.monotonic() - began,
                    )
            return
        consumed = _Consumed(requests)
        with self._pool.get() as ring, pull_errors_abort(context):
            sent = 0

            def into(chunk: Chunk):
                consumed.wait_for(sent - SLOTS + 1)  # the slot's previous chunk was read
                start = ring.offset(sent)
                return ring.segment.view[start : start + chunk.nbytes]

            try:
                for chunk, _ in stream_pull(self.producer, pull, into):
                    yield pb.ShmChunk(
                        header=pb.ChunkHeader(
                            layer_index=chunk.layer_index,
                            first_block=chunk.first,
                            num_blocks=chunk.count,
                        ),
                        segment=ring.segment.name if sent == 0 else "",
                        segment_bytes=ring.segment.size if sent == 0 else 0,
                        offset=ring.offset(sent),
                    )
                    sent += 1
                # The ring goes back to the pool only once the consumer read every slot.
                consumed.wait_for(sent)
            except _ConsumerGone:
                logger.warning("consumer left the shm pull of %s after %d chunks", pull.request_id, sent)

    def _destination(self, first: pb.ShmPullRequest, session, context) -> tuple[peers.Registration, list[int]]:
        """The registered process and the addresses of the layers we push into it, or abort:
        a direct pull writes only into the process that proved itself, inside what it registered."""
        pull = first.pull
        layers = len(self._addresses or ())
        try:
            if self._peers is None:
                raise peers.PeerRefused("this producer serves no direct shm pulls")
            registration = self._peers.lookup(first.registration, session.id, first.pid)
            if len(registration.regions) != layers or len(first.block_ids) != len(pull.block_ids):
                raise peers.PeerRefused(
                    f"direct shm pull of {pull.request_id}: registration has {len(registration.regions)} "
                    f"layers and the pull {len(first.block_ids)} destination blocks, this producer has "
                    f"{layers} layers and the pull {len(pull.block_ids)} blocks"
                )
            row_bytes = self.producer.cache.block_bytes
            if any(registration.regions[i][2] != row_bytes[i] for i in range(layers)):
                raise peers.PeerRefused("registered regions' block sizes differ from this cache's")
            return registration, registration.destinations(first.block_ids, range(layers // 2, layers))
        except peers.PeerRefused as exc:
            if self._peers is not None:
                self._peers.refuse(str(exc))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise

    def _serve_direct(
        self,
        first: pb.ShmPullRequest,
        destination: tuple[peers.Registration, list[int]],
        consumed: _Watched,
        until: float | None,
    ) -> Iterator[pb.ShmChunk]:
        """Hold the lease while the blocks move directly between the two caches: we push the
        upper half of the layers, the consumer reads the lower half itself. The consumer waits
        for this call to end before it gives up on the pull (its fence, ShmClient); we write
        nothing once it has half-closed its side, and hold the lease for its word (its half read)
        only until `until`, past the deadline it sent: a consumer that said nothing by then (its
        process stopped) accepts none of the reads it may still make."""
        pull = first.pull
        assert self._addresses is not None
        registration, addresses = destination
        layers = len(self._addresses)
        row_bytes = self.producer.cache.block_bytes
        push_from = layers // 2
        with self.producer.leased(pull.request_id, list(pull.block_ids), pull.protocol_version, pull.layout_digest):
            yield pb.ShmChunk(pid=os.getpid(), layer_addresses=self._addresses, push_from_layer=push_from)
            pushed = layers - push_from
            local = cma.block_iovecs(self._addresses[push_from:], row_bytes[push_from:], pull.block_ids)
            remote = cma.block_iovecs(addresses, row_bytes[push_from:], first.block_ids)
            faults = self.producer.faults
            with self._lock:
                self.pushing += 1
            if faults.config.push_delay_s:
                time.sleep(faults.config.push_delay_s)  # injected fault: a slow push (fence tests)
            try:
                if consumed.gone:
                    raise KVTransferError("the consumer gave up on the pull")
                if not registration.alive():
                    raise KVTransferError(f"registered process {registration.pid} exited")
                cma.copy(registration.pid, local, remote, write=True)
            except (OSError, KVTransferError) as exc:
                logger.warning(
                    "pushing KV of %s to pid %d failed (%s); the consumer reads it",
                    pull.request_id,
                    registration.pid,
                    exc,
                )
                pushed = 0
            finally:
                with self._lock:
                    self.pushing -= 1
                    self.last_push_end = time.monotonic()
            yield pb.ShmChunk(pushed=True, pushed_layers=pushed)
            consumed.wait_for(1, until)
            self.producer.count_sent(len(pull.block_ids) * self.producer.layout.bytes_per_block())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            rings, self._rings = self._rings, []
        for ring in rings:
            ring.segment.close()
            ring.segment.unlink()
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        atexit.unregister(self.close)
