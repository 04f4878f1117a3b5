"""Mooncake backend: the consumer reads the leased blocks out of the producer's KV cache into its
own with Mooncake's transfer engine (TCP here; RDMA on IB/RoCE NICs), the engine vLLM's
MooncakeConnector, SGLang and vllm-ascend move KV with (mooncake_engine.py: the engine itself).

The producer registers its cache with its transfer engine once, when its KV server starts, and
tells its session (host:port) and the layers' addresses in the handshake of each control
connection, not in every request. The consumer registers its own memory once, on first use.

A pull is one `MooncakeRead` call on the authenticated gRPC channel (control stays there), in
one of two modes the consumer picks:
- in place (both caches in memory Mooncake registers, layers contiguous rows: host caches, and
  device caches with Mooncake's CUDA or NPU build where `mooncake.device_memory` says register:
  by default with rdma): the producer takes the lease (protocol, layout digest, block ids, lease checked as for
  every backend), waits for the event of the forward pass that wrote the blocks, answers `ready`;
  the consumer reads every leased block in one batched transfer, one descriptor per contiguous
  run of blocks (on both sides) per layer, straight into its own blocks (no staging copy); then
  it tells the producer it is done and the producer lets go of the lease.
- staged (any other cache on either side: on a device with the non-CUDA build, or layers that
  are not contiguous rows; and a pull whose runs of blocks are short, `in_place_min_run_bytes`:
  over TCP Mooncake pays per descriptor, and a fragmented cache makes one per block and layer):
  the producer gathers the leased blocks chunk by chunk into registered host slots
  (staging.BlockGatherer: on a device an event-synced, non-blocking copy on a side stream that
  waits on the forward pass's event, the next chunk already in flight) and announces each
  chunk's slot; the consumer reads it (into its cache's rows, a descriptor per run of its
  blocks, where Mooncake can write its cache and its blocks' runs are long; else with one
  descriptor into a registered landing buffer whose bytes its BlockScatterer copies into its
  blocks, on a device event-synced) and says so, which frees the slot.

The producer holds the lease for the whole read, so its blocks cannot be freed while they are
read. A read that fails or outlives the pull's deadline is a failed load (recomputed or failed
per policy); the consumer reports it only once its transfer engine says the batch ended (past
the deadline too: Mooncake ends it by its own transfer timeout, the pull timeout, counted from the
batch's start; one it leaves running past that is still awaited, holding its pull thread, and its
peer gets no new read meanwhile: mooncake_engine.MooncakeEngine.read), so vLLM does not reuse
blocks, nor the consumer a landing buffer, that a late transfer writes.

Mooncake's own ports (its RPC and data connections) are not authenticated (Mooncake has no such
layer) and listen on every interface (0.3.13 has no bind setting): whoever reaches them can read
and write the registered memory (a host cache, or the staging slots), as on an RDMA fabric. So
auto offers mooncake only from KV servers bound beyond loopback (selection.offered_backends),
never picks it with `kv_transfer.tls`, and the README's threat model says so.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import torch

from pdcluster.addresses import binds_every_address
from pdcluster.errors import HandshakeError, KVTransferError
from pdcluster.kv_transfer.kv_cache import Chunk, chunk_plan
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import KVLayout, ProducerInfo
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import BlockGatherer, Pool
from pdcluster.kv_transfer.transports import rpc
from pdcluster.kv_transfer.transports.base import (
    Authorize,
    CacheSink,
    ChunkSink,
    ServerExtension,
    Transport,
    TransportClient,
)
from pdcluster.kv_transfer.transports.collective import local_address_towards
from pdcluster.kv_transfer.transports.grpc_transport import SERVICE, GrpcClient, pull_errors_abort, translate
from pdcluster.kv_transfer.transports.mooncake_engine import (
    MooncakeEngine,
    descriptors,
    engine_for,
    registers,
    run_starts,
    unavailable,
)
from pdcluster.protos import kv_transfer_pb2 as pb


def address_of(data: memoryview) -> int:
    """Where a host buffer's bytes begin."""
    return np.frombuffer(data, dtype=np.uint8).ctypes.data


def in_place(tensors: Sequence[torch.Tensor], settings: KVTransferSettings) -> bool:
    """Whether Mooncake reads and writes these layers where they are: block rows contiguous, in
    host memory or in device memory this build registers (`mooncake.device_memory`)."""
    kind, mooncake = tensors[0].device.type, settings.mooncake
    register = mooncake.device_memory == "register" or (
        mooncake.device_memory == "auto" and mooncake.protocol == "rdma"
    )
    device_ok = kind == "cpu" or (register and registers(kind))
    return device_ok and all(t.is_contiguous() for t in tensors)


def mean_run_bytes(row_bytes: Sequence[int], *id_lists: Sequence[int]) -> float:
    """Bytes per descriptor (averaged over the layers) of a read of these blocks, one per run
    consecutive in every list (inf for no blocks)."""
    if not len(id_lists[0]):
        return math.inf
    return len(id_lists[0]) / len(run_starts(*id_lists)) * sum(row_bytes) / len(row_bytes)


def cache_regions(sink: ChunkSink, settings: KVTransferSettings) -> list[tuple[int, int, int]] | None:
    """Per layer (address, bytes, bytes per block) of the sink's whole cache where Mooncake can
    write it in place, else None (a sink that is not a cache's: plain callables)."""
    if not isinstance(sink, CacheSink):
        return None
    cache = sink.scatterer.cache
    if not in_place(cache.tensors, settings):
        return None
    return [(t.data_ptr(), t.numel() * t.element_size(), row) for t, row in zip(cache.tensors, cache.block_bytes)]


class MooncakeExtension(ServerExtension):
    """The producer's half: its cache (or, staged, its slots) registered once, and the lease held
    while a consumer reads."""

    def __init__(self, producer: KVProducer, settings: KVTransferSettings):
        reason = unavailable()
        if reason is not None:
            raise KVTransferError(reason)
        self.producer = producer
        self.staging_chunk_bytes = settings.mooncake.staging_chunk_bytes
        cache = producer.cache
        # Consumers reach its transfer engine where they reach its KV server.
        advertised = settings.host_for_peers
        if binds_every_address(advertised):
            advertised = socket.gethostbyname(socket.gethostname())
        self.engine = engine_for("producer", advertised, settings)
        self._addresses: list[int] = []
        self._regions: list[tuple[int, int]] = []  # what this server registered, for close()
        if in_place(cache.tensors, settings):
            self._register([(t.data_ptr(), t.numel() * t.element_size()) for t in cache.tensors])
            self._addresses = [t.data_ptr() for t in cache.tensors]
        self._gatherers: Pool[BlockGatherer] = Pool(self._registered_gatherer)

    def _register(self, regions: list[tuple[int, int]]) -> None:
        self.engine.register(regions, self)
        self._regions.extend(regions)

    def _registered_gatherer(self) -> BlockGatherer:
        gatherer = BlockGatherer(self.producer.cache, self.staging_chunk_bytes)
        self._register([(s.host.data_ptr(), s.host.numel()) for s in gatherer.slots])
        return gatherer

    def close(self) -> None:
        self.engine.unregister(self._regions, self)
        self._regions.clear()

    def handshake_fields(self) -> dict:
        return {
            "mooncake_session": self.engine.session,
            "mooncake_layer_addresses": self._addresses,
            "mooncake_staging": True,
        }

    def handlers(self, authorize: Authorize) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "MooncakeRead": rpc.stream_stream(
                authorize, "MooncakeRead", pb.MooncakeReadRequest, pb.MooncakeReadProgress, self._read
            )
        }

    def _read(self, requests: Iterator[pb.MooncakeReadRequest], session, context) -> Iterator[pb.MooncakeReadProgress]:
        first = next(requests, None)
        if first is None or not first.HasField("pull"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "MooncakeRead starts with the pull")
        pull = first.pull
        if not first.staged and not self._addresses:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this producer's cache is read staged only")
        with pull_errors_abort(context):
            with self.producer.leased(
                pull.request_id, list(pull.block_ids), pull.protocol_version, pull.layout_digest
            ) as lease:
                if first.staged:
                    yield from self._staged(pull, lease.ready_event, requests)
                else:
                    if lease.ready_event is not None:
                        lease.ready_event.synchronize()  # the forward pass wrote the device blocks
                    yield pb.MooncakeReadProgress(ready=True)
                    done = next(requests, None)  # the consumer's reads ended, or its call did
                    if done is not None and done.done and not done.error:
                        self.producer.count_sent(done.bytes_read)
            yield pb.MooncakeReadProgress(done=True)

    def _staged(
        self, pull: pb.PullRequest, ready_event: torch.Event | None, requests: Iterator[pb.MooncakeReadRequest]
    ) -> Iterator[pb.MooncakeReadProgress]:
        """Announce each chunk once its slot holds it, then gather the next one into the other
        slot while the consumer reads it; a slot is refilled only after the chunk it held was
        read (the gatherer keeps the previous chunk until it is asked for the one after)."""
        chunk_bytes = min(pull.max_chunk_bytes or self.staging_chunk_bytes, self.staging_chunk_bytes)
        with self._gatherers.get() as gatherer:
            chunks = gatherer.chunks(list(pull.block_ids), ready_event, chunk_bytes, keep_previous=True)
            current = next(chunks, None)
            while current is not None:
                chunk, data = current
                header = pb.ChunkHeader(layer_index=chunk.layer_index, first_block=chunk.first, num_blocks=chunk.count)
                yield pb.MooncakeReadProgress(chunk=header, chunk_address=address_of(data))
                current = next(chunks, None)  # gRPC sent the announcement: gather while it is read
                answer = next(requests, None)
                if answer is None or not answer.chunk_read:
                    return  # the consumer failed (it says why) or went away
                self.producer.count_sent(chunk.nbytes)


class MooncakeClient(GrpcClient):
    """The consumer's half: reads the leased blocks into its own registered memory."""

    def __init__(self, endpoint: str, settings: KVTransferSettings):
        super().__init__(endpoint, settings)
        reason = unavailable()
        if reason is not None:
            raise KVTransferError(f"KV backend mooncake with {endpoint}: {reason}")
        self._read_call = self.channel.stream_stream(
            f"/{SERVICE}/MooncakeRead",
            request_serializer=pb.MooncakeReadRequest.SerializeToString,
            response_deserializer=pb.MooncakeReadProgress.FromString,
        )
        self._handshaken: tuple[KVLayout, str] | None = None
        self._stale = False
        self._landing: Pool[torch.Tensor] | None = None
        self._landing_lock = threading.Lock()  # concurrent first pulls make one pool
        self._landed: list[tuple[MooncakeEngine, torch.Tensor]] = []  # landing buffers, for close()
        self.reads: Counter[str] = Counter()  # pulls by how they were read: in_place, staged, landed
        # A new session: the producer restarted, so its transfer engine and cache addresses are
        # new too; the next pull asks for them again (the hook runs under the session's lock).
        self.control.on_new_session.append(self._forget_regions)

    def _forget_regions(self) -> None:
        self._stale = self._handshaken is not None

    def handshake(self, local_layout: KVLayout, engine_id: str) -> ProducerInfo:
        info = super().handshake(local_layout, engine_id)
        self._handshaken, self._stale = (local_layout, engine_id), False
        return info

    def _producer_regions(self, staged: bool) -> tuple[str, list[int]]:
        """The producer's transfer-engine session and its layers' addresses (none: staged only)."""
        if self._stale and self._handshaken is not None:
            self.handshake(*self._handshaken)
        reply = self.handshake_reply
        assert reply is not None and self._remote_layout is not None
        layers = len(self._remote_layout.layers)
        addresses = list(reply.mooncake_layer_addresses)
        who = reply.engine_id or self.endpoint
        if not reply.mooncake_session or (addresses and len(addresses) != layers):
            raise HandshakeError(
                f"producer {who} describes {len(addresses)} Mooncake layer regions (session "
                f"{reply.mooncake_session or 'none'}), this consumer needs {layers}"
            )
        if (staged or not addresses) and not reply.mooncake_staging:
            raise HandshakeError(
                f"producer {who} serves Mooncake reads in place only (an older pdcluster), this consumer's "
                "cache needs staged reads (a device cache or layers that are not contiguous rows)"
            )
        return reply.mooncake_session, addresses

    def _pull_once(self, request: pb.PullRequest, block_ids: Sequence[int], sink: ChunkSink, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        regions = cache_regions(sink, self.settings)
        self.control.session()  # a new session (the producer restarted) marks its regions stale
        session, remote_bases = self._producer_regions(staged=regions is None)
        engine = engine_for("consumer", local_address_towards(session.rpartition(":")[0]), self.settings)
        if regions is not None:  # our cache, written in place in either mode (registered once)
            engine.register([(address, nbytes) for address, nbytes, _ in regions])
        staged = regions is None or not remote_bases
        if regions is not None and self.handshake_reply.mooncake_staging:
            rows, floor = [row for _, _, row in regions], self.settings.mooncake.run_floor()
            # Short runs: gathered into chunks on the producer (one descriptor each) ...
            staged = staged or mean_run_bytes(rows, block_ids, sink.block_ids) < floor
            if staged and mean_run_bytes(rows, sink.block_ids) < floor:
                regions = None  # ... and landed whole, then scattered into our blocks
        self.reads["in_place" if not staged else "staged" if regions is not None else "landed"] += 1
        if staged:  # chunks travel through registered slots, not gRPC messages
            copy = pb.PullRequest()
            copy.CopyFrom(request)
            copy.max_chunk_bytes = self.settings.mooncake.staging_chunk_bytes
            request = copy
        outbox: queue.Queue[pb.MooncakeReadRequest | None] = queue.Queue()
        outbox.put(pb.MooncakeReadRequest(pull=request, staged=staged))
        call = self._read_call(
            iter(outbox.get, None), metadata=self.control.metadata("MooncakeRead"), timeout=timeout_s
        )
        read = self._read_staged if staged else self._read_in_place
        try:
            try:
                total = read(engine, session, remote_bases, call, outbox, block_ids, sink, deadline, regions)
            except BaseException as exc:
                outbox.put(pb.MooncakeReadRequest(done=True, error=str(exc) or type(exc).__name__))
                raise
        except grpc.RpcError as exc:
            raise translate(exc, self.endpoint, f"KV mooncake read of {request.request_id}") from None
        except BaseException:
            call.cancel()
            raise
        finally:
            outbox.put(None)  # the call's request stream ends in every case (gRPC reads it in a thread)
        return self.check_total(request.request_id, block_ids, total)

    def _read_in_place(self, engine, session, remote_bases, call, outbox, block_ids, sink, deadline, regions) -> int:
        """Every leased block in one batched read from the producer's cache into ours."""
        rows = [row for _, _, row in regions]
        local, remote, lengths = descriptors([a for a, _, _ in regions], remote_bases, rows, block_ids, sink.block_ids)
        ready = next(call, None)
        if ready is None or not ready.ready:
            raise KVTransferError(f"producer {self.endpoint} ended the read unannounced")
        engine.read(session, local, remote, lengths, deadline, self.settings.connect_timeout_seconds)
        total = sum(lengths)
        outbox.put(pb.MooncakeReadRequest(done=True, bytes_read=total))
        if next(call, None) is None:  # the producer held the lease until our reads ended
            raise KVTransferError(f"producer {self.endpoint} ended the read early")
        count = len(block_ids)
        for index, row in enumerate(rows):
            sink.landed(Chunk(index, 0, count, count * row))
        return total

    def _read_staged(self, engine, session, remote_bases, call, outbox, block_ids, sink, deadline, regions) -> int:
        """Chunk by chunk out of the producer's slots: into our cache's rows (`regions`: a host
        cache whose runs of blocks are long) or a landing buffer the sink copies from (a device
        cache, or short runs), each read acknowledged at once so the producer refills the slot
        while we land the chunk."""
        total = 0
        grace = self.settings.connect_timeout_seconds
        with contextlib.ExitStack() as stack:
            landing = None if regions is not None else stack.enter_context(self._landing_pool(engine).get())
            for progress in call:
                if progress.done:  # the producer let go of the lease after our last read
                    return total
                if not progress.HasField("chunk"):
                    raise KVTransferError(f"producer {self.endpoint} announced no chunk in a staged read")
                chunk = self.check_chunk(progress.chunk, len(block_ids))
                if landing is None:
                    address, _, row = regions[chunk.layer_index]
                    own = sink.block_ids[chunk.first : chunk.first + chunk.count]
                    local, remote, lengths = descriptors(
                        [address], [progress.chunk_address], [row], range(chunk.count), own
                    )
                    engine.read(session, local, remote, lengths, deadline, grace)
                    outbox.put(pb.MooncakeReadRequest(chunk_read=True))
                    sink.landed(chunk)
                else:
                    if chunk.nbytes > landing.numel():
                        raise KVTransferError(
                            f"KV chunk of {chunk.nbytes} bytes from {self.endpoint} exceeds the pull's"
                        )
                    engine.read(
                        session, [landing.data_ptr()], [progress.chunk_address], [chunk.nbytes], deadline, grace
                    )
                    outbox.put(pb.MooncakeReadRequest(chunk_read=True))
                    self._land(chunk, landing, sink)
                total += chunk.nbytes
        raise KVTransferError(f"producer {self.endpoint} ended a staged read unannounced")

    def _land(self, chunk: Chunk, landing: torch.Tensor, sink: ChunkSink) -> None:
        """Hand a landed chunk to the sink in pieces of at most `max_chunk_bytes` (the size of
        the scatterer's slots, which the staging chunk may exceed)."""
        row = chunk.nbytes // chunk.count
        for piece in chunk_plan([row], chunk.count, self.settings.max_chunk_bytes):
            data = landing[piece.first * row : piece.first * row + piece.nbytes]
            sink(
                Chunk(chunk.layer_index, chunk.first + piece.first, piece.count, piece.nbytes), memoryview(data.numpy())
            )

    def _landing_pool(self, engine: MooncakeEngine) -> Pool[torch.Tensor]:
        """Host buffers (registered once each) as large as the largest chunk a pull asks for."""
        with self._landing_lock:
            if self._landing is None:
                assert self._remote_layout is not None
                cap = self.settings.mooncake.staging_chunk_bytes
                layers = self._remote_layout.layers
                nbytes = max(max(1, cap // layer.block_bytes) * layer.block_bytes for layer in layers)

                def landing() -> torch.Tensor:
                    buffer = torch.empty(nbytes, dtype=torch.uint8)
                    engine.register([(buffer.data_ptr(), nbytes)], self)
                    self._landed.append((engine, buffer))
                    return buffer

                self._landing = Pool(landing)
            return self._landing

    def close(self) -> None:
        for engine, buffer in self._landed:
            engine.unregister([(buffer.data_ptr(), buffer.numel())], self)
        self._landed.clear()
        super().close()


class MooncakeTransport(Transport):
    name = "mooncake"

    def server_extension(self, producer: KVProducer, host: str) -> MooncakeExtension:
        return MooncakeExtension(producer, self.settings)

    def connect(self, endpoint: str) -> TransportClient:
        return MooncakeClient(endpoint, self.settings)
