"""Mooncake backend: the consumer reads the leased blocks straight out of the producer's KV cache
into its own with Mooncake's transfer engine (TCP here; RDMA on IB/RoCE NICs), the engine vLLM's
MooncakeConnector, SGLang and vllm-ascend move KV with.

Each engine process runs one transfer engine per role (P2P handshake: no metadata server). The
producer registers its cache's layers with it once, when its KV server starts, and tells its
session (host:port) and the layers' addresses in the handshake of each control connection, not
in every request. The consumer registers its own cache once, on its first pull.

A pull is one `MooncakeRead` call on the authenticated gRPC channel (control stays there): the
consumer sends the pull; the producer takes the lease (protocol, layout digest, block ids, lease
checked as for every backend) and answers `ready`; the consumer reads every leased block in one
batched transfer, one descriptor per contiguous run of blocks (on both sides) per layer, directly
into its own blocks (no staging copy); then it tells the producer it is done and the producer lets
go of the lease. The producer holds the lease for the whole read, so its blocks cannot be freed
while they are read. A read that fails or outlives the pull's deadline is a failed load
(recomputed or failed per policy); the consumer reports it only once its transfer engine says
the batch ended (or after a grace period), so vLLM does not reuse blocks a late transfer writes.

Mooncake's own ports (its RPC and data connections) are not authenticated (Mooncake has no such
layer) and listen on every interface (0.3.13 has no bind setting): whoever reaches them can read
and write the registered KV cache, as on an RDMA fabric. So auto offers mooncake only from KV
servers bound beyond loopback (selection.offered_backends), never picks it with
`kv_transfer.tls`, and the README's threat model says so. Host
caches only here: a device cache (CUDA, NPU) is not offered mooncake (it takes collective or
grpc), see the README's NVIDIA and Ascend sections.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from pdcluster.addresses import binds_every_address
from pdcluster.errors import HandshakeError, KVTransferError, TransferTimeoutError
from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import KVLayout, ProducerInfo
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import rpc
from pdcluster.kv_transfer.transports.base import (
    Authorize,
    CacheSink,
    ServerExtension,
    Transport,
    TransportClient,
)
from pdcluster.kv_transfer.transports.collective import local_address_towards
from pdcluster.kv_transfer.transports.grpc_transport import SERVICE, GrpcClient, pull_errors_abort, translate
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

BATCH_PENDING = 1  # get_batch_transfer_status: 0 done, 1 still running, < 0 failed
# Mooncake 0.3.13's TCP transport queues at most 2048 transfers per peer and fails a whole batch
# beyond that (its MC_TCP_* queue settings do not raise it): a pull's ranges go in batches of
# at most this many, one batch at a time per peer.
MAX_BATCH = 2048
POLL_S = (0.0002, 0.005)  # first and longest wait between two looks at a running batch


@functools.lru_cache(maxsize=4)
def unavailable(device_kind: str) -> str | None:
    """Why this process cannot run the mooncake backend for a cache on `device_kind` (None: it
    can). Checked without importing Mooncake, which reads its settings when imported (the first
    engine does that, _configure first). The wheel links libibverbs/librdmacm even for TCP
    (tools/system_deps.sh installs them)."""
    if device_kind != "cpu":
        return f"the mooncake backend reads host caches; this cache is on {device_kind}"
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake's transfer engine is not installed (mooncake-transfer-engine-non-cuda)"
    for library in ("libibverbs.so.1", "librdmacm.so.1"):
        try:
            ctypes.CDLL(library)
        except OSError as exc:
            return f"Mooncake's transfer engine needs {library} ({exc}; apt-get install libibverbs1 librdmacm1)"
    return None


def _configure(settings: KVTransferSettings) -> None:
    """Mooncake reads its settings from the environment when `mooncake.engine` is imported: its
    transfers bounded by the pull timeout (seconds), its log at warnings. An operator's own MC_*
    values win. (Its ports stay its own: it refuses ranges inside the kernel's ephemeral one,
    where the KV port range lies by default.)"""
    wanted = {
        "MC_TRANSFER_TIMEOUT": str(math.ceil(settings.pull_timeout_seconds)),
        "MC_LOG_LEVEL": "WARNING",
        "GLOG_minloglevel": "1",
    }
    for name, value in wanted.items():
        os.environ.setdefault(name, value)


class MooncakeEngine:
    """One transfer engine of this process, the regions it registered, and batched reads."""

    def __init__(self, host: str, settings: KVTransferSettings):
        _configure(settings)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise KVTransferError(f"Mooncake's transfer engine cannot be imported: {exc}") from exc
        self.protocol = settings.mooncake.protocol
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, settings.mooncake.device_name)
        if rc != 0:
            raise KVTransferError(f"Mooncake's transfer engine did not start on {host} ({self.protocol}): code {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._peers: dict[str, threading.Lock] = {}  # one batch in flight per peer (MAX_BATCH)
        logger.info("Mooncake transfer engine %s (%s)", self.session, self.protocol)

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register (address, bytes) regions not registered yet; a registered region a new one
        overlaps belonged to a cache that is gone (its memory reused): it is unregistered."""
        with self._lock:
            new = [region for region in regions if region not in self._registered]
            if not new:
                return
            for old in [r for r in self._registered if any(_overlap(r, region) for region in new)]:
                self.engine.unregister_memory(old[0])
                self._registered.discard(old)
            rc = self.engine.batch_register_memory([a for a, _ in new], [n for _, n in new])
            if rc != 0:
                raise KVTransferError(f"Mooncake could not register {len(new)} KV cache regions: code {rc}")
            self._registered.update(new)

    def read(
        self, session: str, local: list[int], remote: list[int], lengths: list[int], deadline: float, grace_s: float
    ) -> None:
        """Read each remote range of `session` into the local one at the same index, at most
        MAX_BATCH ranges in flight to that peer (from any thread); raises on failure or past
        `deadline`, but only once the batch in flight ended (or `grace_s` after it)."""
        with self._lock:
            peer = self._peers.setdefault(session, threading.Lock())
        with peer:
            for start in range(0, len(local), MAX_BATCH):
                end = start + MAX_BATCH
                self._read_batch(session, local[start:end], remote[start:end], lengths[start:end], deadline, grace_s)

    def _read_batch(
        self, session: str, local: list[int], remote: list[int], lengths: list[int], deadline: float, grace_s: float
    ) -> None:
        batch = self.engine.batch_transfer_async_read(session, local, remote, lengths)
        if not batch:
            raise KVTransferError(f"Mooncake could not start a read from {session}")
        wait, late = POLL_S[0], None
        while (status := self.engine.get_batch_transfer_status([batch])) == BATCH_PENDING:
            now = time.monotonic()
            if late is None and now > deadline:
                late = now
            if late is not None and now > late + grace_s:
                raise TransferTimeoutError(
                    f"Mooncake read from {session} still running {grace_s:.0f} s past its deadline"
                )
            time.sleep(wait)  # poll interval: the engine's status has no blocking wait
            wait = min(wait * 2, POLL_S[1])
        if status != 0:
            raise KVTransferError(f"Mooncake read of {sum(lengths)} bytes from {session} failed (status {status})")
        if late is not None:
            raise TransferTimeoutError(f"Mooncake read from {session} ended past the pull's deadline")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


_engines: dict[str, MooncakeEngine] = {}
_engines_lock = threading.Lock()


def engine_for(role: str, host: str, settings: KVTransferSettings) -> MooncakeEngine:
    """This process's transfer engine for `role` (producer | consumer), started on first use."""
    key = f"{role}@{host}"
    with _engines_lock:
        if key not in _engines:
            _engines[key] = MooncakeEngine(host, settings)
        return _engines[key]


def descriptors(
    local_bases: Sequence[int],
    remote_bases: Sequence[int],
    row_bytes: Sequence[int],
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths): one per layer and run of blocks consecutive
    on both sides (block b of a layer is row bytes at base + b * row)."""
    src = np.asarray(remote_ids, dtype=np.int64)
    dst = np.asarray(local_ids, dtype=np.int64)
    if len(src) != len(dst):
        raise KVTransferError(f"{len(src)} producer blocks for {len(dst)} consumer blocks")
    if not len(src):
        return [], [], []
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    runs = np.diff(np.concatenate((starts, [len(src)])))
    local, remote, lengths = [], [], []
    for local_base, remote_base, row in zip(local_bases, remote_bases, row_bytes):
        local.append(local_base + dst[starts] * row)
        remote.append(remote_base + src[starts] * row)
        lengths.append(runs * row)
    return (np.concatenate(local).tolist(), np.concatenate(remote).tolist(), np.concatenate(lengths).tolist())


class MooncakeExtension(ServerExtension):
    """The producer's half: its cache registered once, and the lease held while a consumer reads."""

    def __init__(self, producer: KVProducer, settings: KVTransferSettings):
        cache = producer.cache
        reason = unavailable(cache.device.type)
        if reason is None and not all(t.is_contiguous() for t in cache.tensors):
            reason = "the mooncake backend needs every KV layer as contiguous block rows"
        if reason is not None:
            raise KVTransferError(reason)
        self.producer = producer
        # Consumers reach its transfer engine where they reach its KV server.
        advertised = settings.host_for_peers
        if binds_every_address(advertised):
            advertised = socket.gethostbyname(socket.gethostname())
        self.engine = engine_for("producer", advertised, settings)
        self.engine.register([(t.data_ptr(), t.numel() * t.element_size()) for t in cache.tensors])
        self._addresses = [t.data_ptr() for t in cache.tensors]

    def handshake_fields(self) -> dict:
        return {"mooncake_session": self.engine.session, "mooncake_layer_addresses": self._addresses}

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
        with pull_errors_abort(context):
            with self.producer.leased(pull.request_id, list(pull.block_ids), pull.protocol_version, pull.layout_digest):
                yield pb.MooncakeReadProgress(ready=True)
                done = next(requests, None)  # the consumer's reads ended, or its call did
            if done is not None and done.done and not done.error:
                self.producer.bytes_sent += done.bytes_read
            yield pb.MooncakeReadProgress(done=True)


class MooncakeClient(GrpcClient):
    """The consumer's half: reads the leased blocks into its own registered cache."""

    def __init__(self, endpoint: str, settings: KVTransferSettings, device: str = "cpu"):
        super().__init__(endpoint, settings)
        reason = unavailable(device)
        if reason is not None:
            raise KVTransferError(f"KV backend mooncake with {endpoint}: {reason}")
        self._read_call = self.channel.stream_stream(
            f"/{SERVICE}/MooncakeRead",
            request_serializer=pb.MooncakeReadRequest.SerializeToString,
            response_deserializer=pb.MooncakeReadProgress.FromString,
        )
        self._handshaken: tuple[KVLayout, str] | None = None
        self._stale = False
        # A new session: the producer restarted, so its transfer engine and cache addresses are
        # new too; the next pull asks for them again (the hook runs under the session's lock).
        self.control.on_new_session.append(self._forget_regions)

    def _forget_regions(self) -> None:
        self._stale = self._handshaken is not None

    def handshake(self, local_layout: KVLayout, engine_id: str) -> ProducerInfo:
        info = super().handshake(local_layout, engine_id)
        self._handshaken, self._stale = (local_layout, engine_id), False
        return info

    def _producer_regions(self) -> tuple[str, list[int]]:
        if self._stale and self._handshaken is not None:
            self.handshake(*self._handshaken)
        reply = self.handshake_reply
        assert reply is not None and self._remote_layout is not None
        layers = len(self._remote_layout.layers)
        if not reply.mooncake_session or len(reply.mooncake_layer_addresses) != layers:
            raise HandshakeError(
                f"producer {reply.engine_id or self.endpoint} describes {len(reply.mooncake_layer_addresses)} "
                f"Mooncake layer regions (session {reply.mooncake_session or 'none'}), this consumer "
                f"needs {layers}"
            )
        return reply.mooncake_session, list(reply.mooncake_layer_addresses)

    def _pull_once(self, request: pb.PullRequest, block_ids: Sequence[int], sink: CacheSink, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        regions = sink.host_regions()
        if regions is None:
            raise KVTransferError("the mooncake backend reads into host caches; this consumer's cache is not one")
        self.control.session()  # a new session (the producer restarted) marks its regions stale
        session, remote_bases = self._producer_regions()
        host = session.rpartition(":")[0]
        engine = engine_for("consumer", local_address_towards(host), self.settings)
        engine.register([(address, nbytes) for address, nbytes, _ in regions])
        rows = [row for _, _, row in regions]
        local, remote, lengths = descriptors([a for a, _, _ in regions], remote_bases, rows, block_ids, sink.block_ids)
        total = sum(lengths)
        outbox: queue.Queue[pb.MooncakeReadRequest | None] = queue.Queue()
        outbox.put(pb.MooncakeReadRequest(pull=request))
        call = self._read_call(
            iter(outbox.get, None), metadata=self.control.metadata("MooncakeRead"), timeout=timeout_s
        )
        try:
            ready = next(call, None)
            if ready is None or not ready.ready:
                raise KVTransferError(f"producer {self.endpoint} ended the read of {request.request_id} unannounced")
            try:
                engine.read(session, local, remote, lengths, deadline, self.settings.connect_timeout_seconds)
            except BaseException as exc:
                outbox.put(pb.MooncakeReadRequest(done=True, error=str(exc) or type(exc).__name__))
                raise
            outbox.put(pb.MooncakeReadRequest(done=True, bytes_read=total))
            if next(call, None) is None:  # the producer held the lease until our reads ended
                raise KVTransferError(f"producer {self.endpoint} ended the read of {request.request_id} early")
        except grpc.RpcError as exc:
            raise translate(exc, self.endpoint, f"KV mooncake read of {request.request_id}") from None
        except BaseException:
            call.cancel()
            raise
        finally:
            outbox.put(None)  # the call's request stream ends in every case (gRPC reads it in a thread)
        count = len(block_ids)
        for index, row in enumerate(rows):
            sink.landed(Chunk(index, 0, count, count * row))
        return self.check_total(request.request_id, block_ids, total)


class MooncakeTransport(Transport):
    name = "mooncake"

    def server_extension(self, producer: KVProducer, host: str) -> MooncakeExtension:
        return MooncakeExtension(producer, self.settings)

    def connect(self, endpoint: str) -> TransportClient:
        return MooncakeClient(endpoint, self.settings, self.device)
