"""Shared-memory backend (same host): gRPC carries control only, KV bytes move through /dev/shm.

Producer: `ShmExtension` adds the bidirectional `ShmPull` RPC to the control server. A pull
borrows a ring (one POSIX shm segment, mode 0600, of `SLOTS` chunk-sized slots) from a pool; the
producer gathers chunk i straight from its cache into slot i % SLOTS and streams a `ShmChunk`
saying where it lies. Before it overwrites a slot it waits until the consumer reported
(`consumed`) that it copied that chunk out, so the producer's gather of the next chunks overlaps
the consumer's scatter of this one: one copy in each process, on two cores. The segment's name is
only ever sent in reply to an authenticated call. Segments are unlinked when the server stops,
and at interpreter exit.

Consumer: `ShmClient` (the gRPC client, plus ShmPull) maps each segment once, read-only, and
hands the sink zero-copy views of the slots.

Direct variant (both caches in host memory): two copies through a segment cost twice the memory
traffic of one, so where the OS lets the peers copy between each other's memory (cma.py) the
consumer proves which process it is and registers its cache (peers.py), then names its
registration and destination blocks; the producer, holding the lease, answers with its own
addresses and then writes the upper half of the layers into the consumer's registered cache
while the consumer reads the lower half from the producer's: one copy per byte, on two cores. From the
second pull on, the consumer knows the producer's addresses and copies its half while the request
is still on its way (`_read_early`), and it returns once every byte is in, leaving the call to end
in the background. Where the OS refuses (EPERM), the client falls back to the ring for good.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
from collections.abc import Iterator, Sequence

import grpc

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import Pool
from pdcluster.kv_transfer.transports import cma, peers, rpc
from pdcluster.kv_transfer.transports.base import (
    Authorize,
    CacheSink,
    ChunkSink,
    ServerExtension,
    Transport,
    TransportClient,
)
from pdcluster.kv_transfer.transports.direct import DirectRead, DirectRefused
from pdcluster.kv_transfer.transports.grpc_transport import (
    SERVICE,
    GrpcClient,
    pull_errors_abort,
    stream_pull,
    translate,
)
from pdcluster.kv_transfer.transports.segments import SLOTS, Ring, Segment
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)


class _ConsumerGone(Exception):
    pass


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


class ShmExtension(ServerExtension):
    def __init__(self, producer: KVProducer):
        self.producer = producer
        slot_bytes = producer.cache.max_chunk_nbytes(producer.max_chunk_bytes)
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
        consumed = _Consumed(requests)
        if first.direct:
            destination = self._destination(first, session, context)
            with pull_errors_abort(context):
                try:
                    yield from self._serve_direct(first, destination, consumed)
                except _ConsumerGone:
                    logger.warning("consumer left the direct shm pull of %s", pull.request_id)
            return
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
        self, first: pb.ShmPullRequest, destination: tuple[peers.Registration, list[int]], consumed: _Consumed
    ) -> Iterator[pb.ShmChunk]:
        """Hold the lease while the blocks move directly between the two caches: we push the
        upper half of the layers, the consumer reads the lower half itself."""
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
            try:
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
            yield pb.ShmChunk(pushed=True, pushed_layers=pushed)
            consumed.wait_for(1)
            self.producer.bytes_sent += len(pull.block_ids) * self.producer.layout.bytes_per_block()

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


class ShmClient(GrpcClient):
    def __init__(self, endpoint: str, settings: KVTransferSettings):
        super().__init__(endpoint, settings)
        self._shm_pull = self.channel.stream_stream(
            f"/{SERVICE}/ShmPull",
            request_serializer=pb.ShmPullRequest.SerializeToString,
            response_deserializer=pb.ShmChunk.FromString,
        )
        self._shm_register = self.channel.unary_unary(
            f"/{SERVICE}/ShmRegister",
            request_serializer=pb.ShmRegisterRequest.SerializeToString,
            response_deserializer=pb.ShmRegisterResponse.FromString,
        )
        self._segments: dict[str, Segment] = {}
        self._segments_lock = threading.Lock()
        self.direct = cma.available()  # until the OS refuses a direct read from this producer
        # The producer's last direct notice (pid, cache addresses, split): lets the next pull
        # read its half while the request is still on its way (see _read_early).
        self._peer: pb.ShmChunk | None = None
        self._settling: set = set()  # direct pulls' calls still ending (set ops are atomic)
        # Our registration for direct pushes (peers.py), on the current session only.
        self._registration = ""
        self._proof: socket.socket | None = None  # the peer connection it was proven on
        self.control.on_new_session.append(self._new_session)

    def _new_session(self) -> None:
        """The producer forgot us (restarted): its registration and addresses are gone."""
        self._forget_registration()
        self._peer = None

    def _forget_registration(self) -> None:
        self._registration = ""
        if self._proof is not None:
            self._proof.close()
            self._proof = None

    def _register(self, sink: CacheSink) -> str:
        """Prove which process we are on the producer's peer socket and register our cache
        there (once per session); "" when the producer offers no direct pushes."""
        if self._registration or not self.shm_socket:
            return self._registration
        regions = sink.host_regions()
        assert regions is not None
        try:
            proof, token = peers.prove(self.shm_socket, self.settings.connect_timeout_seconds)
        except OSError as exc:
            raise DirectRefused(f"peer socket of {self.endpoint}: {exc}") from exc
        request = pb.ShmRegisterRequest(
            token=token,
            pid=os.getpid(),
            regions=[pb.Region(address=a, nbytes=n, row_bytes=r) for a, n, r in regions],
        )
        try:
            reply = self._shm_register(
                request,
                metadata=self.control.metadata("ShmRegister"),
                timeout=self.settings.connect_timeout_seconds,
            )
        except grpc.RpcError as exc:
            proof.close()
            error = translate(exc, self.endpoint, "KV shm registration")
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                raise DirectRefused(str(error)) from None
            raise error from None
        self._proof, self._registration = proof, reply.registration
        return self._registration

    def _attach(self, name: str, size: int) -> Segment:
        with self._segments_lock:
            segment = self._segments.get(name)
            if segment is None:
                try:
                    segment = Segment(name, size, create=False)
                except OSError as exc:
                    raise KVTransferError(
                        f"cannot map the producer's shared memory {name} ({exc}); "
                        "is the producer on another host? use kv_transfer.backend grpc or auto"
                    ) from exc
                self._segments[name] = segment
            return segment

    def pull(
        self,
        request_id: str,
        block_ids: Sequence[int],
        sink: ChunkSink,
        *,
        engine_id: str,
        timeout_s: float,
    ) -> int:
        request = self.pull_request(request_id, block_ids, engine_id)
        return self.control.call(lambda: self._pull_once(request, block_ids, sink, timeout_s))

    def _pull_once(self, request: pb.PullRequest, block_ids: Sequence[int], sink: ChunkSink, timeout_s: float) -> int:
        rows = sink.host_rows() if self.direct and self.shm_socket and isinstance(sink, CacheSink) else None
        if rows is not None:
            try:
                return self._pull_shm(request, block_ids, sink, timeout_s, rows)
            except DirectRefused as exc:
                self.direct = False
                logger.warning(
                    "direct reads from %s refused (%s); using the shared-memory ring from now on",
                    self.endpoint,
                    exc,
                )
        return self._pull_shm(request, block_ids, sink, timeout_s, None)

    def _pull_shm(
        self,
        request: pb.PullRequest,
        block_ids: Sequence[int],
        sink: ChunkSink,
        timeout_s: float,
        rows: list[tuple[int, int]] | None,
    ) -> int:
        outbox: queue.SimpleQueue[pb.ShmPullRequest | None] = queue.SimpleQueue()
        if rows is None:
            outbox.put(pb.ShmPullRequest(pull=request))
        else:
            assert isinstance(sink, CacheSink)
            outbox.put(
                pb.ShmPullRequest(
                    pull=request,
                    direct=True,
                    pid=os.getpid(),
                    registration=self._register(sink),
                    block_ids=sink.block_ids,
                )
            )

        def messages() -> Iterator[pb.ShmPullRequest]:
            while (message := outbox.get()) is not None:
                yield message

        call = self._shm_pull(messages(), metadata=self.control.metadata("ShmPull"), timeout=timeout_s)
        received = consumed = 0
        segment: Segment | None = None
        direct: DirectRead | None = None
        try:
            early = self._read_early(block_ids, sink, rows) if rows is not None else None
            for note in call:
                if note.pid or note.pushed:
                    if rows is None or (note.pid and direct) or (note.pushed and not direct):
                        raise KVTransferError(f"unexpected direct shm notice from {self.endpoint}")
                    assert isinstance(sink, CacheSink) and self._remote_layout is not None
                    if note.pid:
                        self._peer = pb.ShmChunk(
                            pid=note.pid,
                            layer_addresses=note.layer_addresses,
                            push_from_layer=note.push_from_layer,
                        )
                        if early is not None and early.note == self._peer:
                            direct = early  # our half is in; the notice says it was leased
                            direct.landed(0, note.push_from_layer)
                        else:
                            direct = DirectRead(note, self._remote_layout, block_ids, sink, rows)
                            direct.read(0, note.push_from_layer)
                    else:
                        received += direct.finish(note.pushed_layers)
                        outbox.put(pb.ShmPullRequest(consumed=1))
                        # Every byte is in: no need to wait for the producer to end the call.
                        self._settle(call)
                        break
                    continue
                chunk = self.check_chunk(note.header, len(block_ids))
                if note.segment:
                    segment = self._attach(note.segment, note.segment_bytes)
                if segment is None or note.offset + chunk.nbytes > segment.size:
                    raise KVTransferError(f"malformed shm chunk {note} from {self.endpoint}")
                sink(chunk, segment.view[note.offset : note.offset + chunk.nbytes])
                received += chunk.nbytes
                consumed += 1
                outbox.put(pb.ShmPullRequest(consumed=consumed))
        except grpc.RpcError as exc:
            if rows is not None and exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._forget_registration()
                raise DirectRefused(exc.details()) from None
            raise translate(exc, self.endpoint, f"KV shm pull of {request.request_id}") from None
        except BaseException:
            call.cancel()
            raise
        finally:
            outbox.put(None)
        return self.check_total(request.request_id, block_ids, received)

    def _settle(self, call) -> None:
        """Let a call end in the background: dropping the last reference would cancel it."""
        self._settling.add(call)
        call.add_done_callback(self._settling.discard)

    def _read_early(self, block_ids: Sequence[int], sink: ChunkSink, rows: list[tuple[int, int]]) -> DirectRead | None:
        """Copy our half of the layers before the producer's notice arrives; None if we cannot.

        Safe because blocks are only ever freed after their lease is released or expired, and a
        released or expired lease is never acquired again: if the notice then arrives (sent
        while the producer holds the lease), the lease was live through this whole copy, so the
        blocks held the prefill's KV. If the pull fails instead, the copy is discarded with it.
        A notice naming another process or other addresses than this copy used (producer
        restarted on the same endpoint) makes the pull read again.
        """
        if self._peer is None:
            return None
        assert isinstance(sink, CacheSink) and self._remote_layout is not None
        reader = DirectRead(self._peer, self._remote_layout, block_ids, sink, rows)
        try:
            reader.copy(0, self._peer.push_from_layer)
        except (DirectRefused, KVTransferError) as exc:
            logger.info("early read from %s failed (%s); reading after the notice", self.endpoint, exc)
            self._peer = None
            return None
        return reader

    def close(self) -> None:
        with self._segments_lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()
        self._forget_registration()
        super().close()


class ShmTransport(Transport):
    name = "shm"

    def server_extension(self, producer: KVProducer, host: str) -> ShmExtension:
        return ShmExtension(producer)

    def connect(self, endpoint: str) -> TransportClient:
        return ShmClient(endpoint, self.settings)
