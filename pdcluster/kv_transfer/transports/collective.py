"""Collective backend: KV moves as torch.distributed point-to-point send/recv between a P and a
D worker; the authenticated gRPC channel carries control (rendezvous, which request and blocks,
errors).

Pair setup, on a consumer's first pull from a producer endpoint: the consumer calls
`CollectiveOpen`; the producer makes the pair's rendezvous store (a key-value dict in its own
process, `PairStore`) under a random group key bound to the consumer's session, and both sides
build a standalone two-rank group over it (producer rank 0, consumer rank 1): the producer on the
store itself, the consumer through `RemoteStore`, whose set/get are `CollectiveStore` calls on
its session. No store port is ever opened, so nobody outside the cluster can read the ranks'
addresses or write their own into a pair's rendezvous, and no other session can reach the pair.
The group is never the default process group vLLM may have made and belongs to this pair only,
so replicas can come and go with scaling. A consumer that opens again (its group broke) replaces
its old pair.

A pull: the consumer holds its pair's lock (one pull at a time per pair) and calls
`CollectivePull` with a fresh tag; the producer holds the lease and the pair's lock, announces the
chunk plan, then gathers chunk by chunk into two buffers on the cache's device and posts sends
while the consumer posts recvs into two buffers and scatters each into its cache. A send/recv
that fails or times out breaks the pair on both sides (the next pull opens a new one).

Backend by device: gloo on CPU (tested here), NCCL on CUDA, HCCL on Ascend (torch_npu): the same
code; only the backend name and the buffers' device differ. NCCL and HCCL are untested on
hardware here (tools/kv_collective_device_check.py exercises them on a GPU host). The ranks'
send/recv connections are the backend's own (gloo's TCP pairs, NCCL's sockets or RDMA): they
carry KV unencrypted, also with `kv_transfer.tls` (README, threat model).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch

from pdcluster import compat
from pdcluster.errors import HandshakeError, KVTransferError
from pdcluster.kv_transfer.kv_cache import Chunk, PagedKVCache, chunk_plan
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import DeviceContext, Pool, gather_blocks
from pdcluster.kv_transfer.transports import rpc
from pdcluster.kv_transfer.transports.base import (
    Authorize,
    ChunkSink,
    ServerExtension,
    Transport,
    TransportClient,
)
from pdcluster.kv_transfer.transports.grpc_transport import (
    GrpcClient,
    pull_errors_abort,
    translate,
)
from pdcluster.kv_transfer.transports.rendezvous import PairStore, RemoteStore
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

# Device kind -> torch.distributed backend. "auto" uses the collective path only on accelerators.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
MAX_PAIRS = 64  # producer side: the oldest pairs are dropped beyond this (consumers come and go)
PRODUCER, CONSUMER = 0, 1


def backend_for(device_kind: str) -> str:
    try:
        return BACKENDS[device_kind]
    except KeyError:
        raise KVTransferError(f"no collective backend for device kind {device_kind!r}") from None


def make_pair_group(backend: str, store, rank: int, timeout: timedelta, host: str):
    """A standalone two-rank group (never the default group), ranks 0 = producer, 1 = consumer.

    Built from torch.distributed's private process-group options (pdcluster.compat.torch_dist)."""
    if backend == "gloo":
        return compat.gloo_pair_group(store, rank, 2, timeout, host)
    if backend == "nccl":
        return compat.nccl_pair_group(store, rank, 2, timeout)
    if backend == "hccl":
        return compat.hccl_pair_group(store, rank, 2, timeout)
    raise KVTransferError(f"unknown collective backend {backend!r}")


def local_address_towards(host: str) -> str:
    """The local address this host uses to reach `host` (what gloo must bind to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing
        return probe.getsockname()[0]


class _Buffers:
    """Two reusable chunk buffers on the cache's device (double buffering)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        buffer = self._buffers[index % 2]
        if buffer.numel() < nbytes:
            buffer = self._buffers[index % 2] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]


def send_chunks(
    group, cache: PagedKVCache, block_ids: Sequence[int], plan: list[Chunk], ready_event, tag: int, buffers: _Buffers
) -> int:
    """Producer: gather each chunk into a buffer and send it; two sends in flight."""
    ctx = DeviceContext(cache.device)
    ctx.compute_stream_wait(ready_event)  # the forward pass wrote the blocks
    index = ctx.index_tensor(block_ids)
    works: list = [None, None]
    sent = 0
    for i, chunk in enumerate(plan):
        if works[i % 2] is not None:
            works[i % 2].wait()  # that buffer's previous send is done
        buffer = buffers.get(i, chunk.nbytes)
        gather_blocks(cache.tensors[chunk.layer_index], chunk, block_ids, index, buffer)
        works[i % 2] = group.send([buffer], CONSUMER, tag)
        sent += chunk.nbytes
    for work in works:
        if work is not None:
            work.wait()
    # On a device, wait() only orders this thread's stream after the send (NCCL/HCCL): the gathers
    # still queued there read the leased blocks. The lease ends when this returns (vLLM may hand
    # the blocks to another request), so its reads must be done: wait here, off the forward's path.
    done = ctx.record_compute_event()
    if done is not None:
        done.synchronize()
    return sent


def recv_chunks(group, device: torch.device, plan: list[Chunk], tag: int, buffers: _Buffers, sink: ChunkSink) -> int:
    """Consumer: receive the chunks in plan order (two recvs in flight) and hand each to sink."""
    works: list = [None, None]

    def post(i: int) -> None:
        works[i % 2] = group.recv([buffers.get(i, plan[i].nbytes)], PRODUCER, tag)

    for i in range(min(2, len(plan))):
        post(i)
    received = 0
    for i, chunk in enumerate(plan):
        works[i % 2].wait()
        data = buffers.get(i, chunk.nbytes)
        sink(chunk, data if device.type != "cpu" else memoryview(data.numpy()))
        received += chunk.nbytes
        if i + 2 < len(plan):
            post(i + 2)
    return received


@dataclass
class _Pair:
    key: str
    consumer: str
    session: str  # the consumer's authenticated session: the only one that may use the pair
    store: PairStore
    group: Future
    lock: threading.Lock = field(default_factory=threading.Lock)


class CollectiveExtension(ServerExtension):
    def __init__(self, producer: KVProducer, settings: KVTransferSettings, host: str):
        self.producer = producer
        self.settings = settings
        self.device = producer.cache.device
        self.backend = backend_for(self.device.type)
        self.host = host
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        self._lock = threading.Lock()
        # A build waits up to the pull timeout for its consumer: one per pair kept, so consumers
        # that open and never join do not hold up the others' rendezvous
        self._opener = ThreadPoolExecutor(max_workers=MAX_PAIRS, thread_name_prefix="kv-collective")
        # Pulls on different pairs run at once: each borrows its own two chunk buffers.
        self._buffers: Pool[_Buffers] = Pool(lambda: _Buffers(self.device))
        self._timeout = timedelta(seconds=settings.pull_timeout_seconds)

    def handlers(self, authorize: Authorize) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "CollectiveOpen": rpc.unary_unary(
                authorize, "CollectiveOpen", pb.CollectiveOpenRequest, pb.CollectiveOpenResponse, self._open
            ),
            "CollectivePull": rpc.unary_stream(
                authorize,
                "CollectivePull",
                pb.CollectivePullRequest,
                self._pull,
                pb.CollectiveProgress.SerializeToString,
            ),
            "CollectiveStore": rpc.unary_unary(
                authorize, "CollectiveStore", pb.CollectiveStoreRequest, pb.CollectiveStoreResponse, self._store_op
            ),
        }

    def _pair(self, key: str, session, context) -> _Pair:
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None or pair.session != session.id:
            context.abort(grpc.StatusCode.ABORTED, "unknown collective group: open a new one")
        return pair

    def _store_op(self, request: pb.CollectiveStoreRequest, session, context) -> pb.CollectiveStoreResponse:
        pair = self._pair(request.group_key, session, context)
        try:
            if request.op == "set":
                pair.store.set(request.key, request.value)
                return pb.CollectiveStoreResponse()
            if request.op == "get":
                timeout_s = min(request.timeout_ms / 1000, self._timeout.total_seconds())
                return pb.CollectiveStoreResponse(value=pair.store.get(request.key, timeout_s))
        except KVTransferError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown collective store op {request.op!r}")

    def _open(self, request: pb.CollectiveOpenRequest, session, context) -> pb.CollectiveOpenResponse:
        if request.backend != self.backend or request.device_kind != self.device.type:
            error = (
                f"collective backend mismatch: prefill (producer) uses {self.backend} on "
                f"{self.device.type}, decode (consumer) {request.backend} on {request.device_kind}"
            )
            logger.error("%s", error)
            return pb.CollectiveOpenResponse(backend=self.backend, error=error)
        key = secrets.token_hex(16)
        store = PairStore(self._timeout)
        with self._lock:
            for old in [p for p in self._pairs.values() if p.session == session.id]:
                del self._pairs[old.key]  # that consumer's previous group broke
                old.group.cancel()  # (a build not started yet)
            while len(self._pairs) >= MAX_PAIRS:
                self._pairs.popitem(last=False)[1].group.cancel()
            group = self._opener.submit(make_pair_group, self.backend, store, PRODUCER, self._timeout, self.host)
            self._pairs[key] = _Pair(key, session.consumer, session.id, store, group)
        logger.info("KV collective pair with %s (%s) opening", session.consumer, self.backend)
        return pb.CollectiveOpenResponse(group_key=key, backend=self.backend)

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.pop(pair.key, None)

    def _pull(self, request: pb.CollectivePullRequest, session, context) -> Iterator[pb.CollectiveProgress]:
        pair = self._pair(request.group_key, session, context)
        try:
            group = pair.group.result(timeout=self._timeout.total_seconds())
        except Exception as exc:  # rendezvous failed (timeout, peer gone): the pair is unusable
            self._drop(pair)
            context.abort(grpc.StatusCode.ABORTED, f"collective rendezvous failed: {exc}")
        pull = request.pull
        block_ids = list(pull.block_ids)
        with pair.lock, self._buffers.get() as buffers, pull_errors_abort(context):
            try:
                with self.producer.leased(
                    pull.request_id, block_ids, pull.protocol_version, pull.layout_digest
                ) as lease:
                    chunk_bytes = self.producer.chunk_bytes(pull.max_chunk_bytes)
                    plan = self.producer.cache.chunk_plan(len(block_ids), chunk_bytes)
                    yield pb.CollectiveProgress(num_chunks=len(plan), chunk_bytes=chunk_bytes)
                    sent = send_chunks(
                        group,
                        self.producer.cache,
                        block_ids,
                        plan,
                        lease.ready_event,
                        request.tag,
                        buffers,
                    )
                    self.producer.count_sent(sent)
                yield pb.CollectiveProgress(bytes_sent=sent, done=True)
            except RuntimeError as exc:  # torch.distributed errors (DistError is one)
                self._drop(pair)
                context.abort(grpc.StatusCode.ABORTED, f"collective send failed: {exc}")

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()
        self._opener.shutdown(wait=False, cancel_futures=True)


class CollectiveClient(GrpcClient):
    def __init__(self, endpoint: str, settings: KVTransferSettings, device: str = "cpu"):
        super().__init__(endpoint, settings)
        self.device = torch.device(device)
        self.backend = backend_for(self.device.type)
        self._open = self.control.stub("CollectiveOpen", pb.CollectiveOpenRequest, pb.CollectiveOpenResponse)
        self._collective_pull = self.control.stub(
            "CollectivePull", pb.CollectivePullRequest, pb.CollectiveProgress, kind="unary_stream"
        )
        self._store = self.control.stub("CollectiveStore", pb.CollectiveStoreRequest, pb.CollectiveStoreResponse)
        self._pair_lock = threading.Lock()
        self._group = None
        self._key = ""
        self._tag = 0
        self._buffers = _Buffers(self.device)
        self._timeout = timedelta(seconds=settings.pull_timeout_seconds)
        self.control.on_new_session.append(self._forget_group)  # a new session: the pair is gone

    def _forget_group(self) -> None:
        self._group = None

    def store_call(self, request: pb.CollectiveStoreRequest, timeout: float) -> pb.CollectiveStoreResponse:
        return self._store(request, metadata=self.control.metadata("CollectiveStore"), timeout=timeout)

    def _ensure_group(self, engine_id: str):
        if self._group is not None:
            return self._group
        try:
            reply = self._open(
                pb.CollectiveOpenRequest(
                    consumer_engine_id=engine_id, backend=self.backend, device_kind=self.device.type
                ),
                metadata=self.control.metadata("CollectiveOpen"),
                timeout=self.settings.connect_timeout_seconds,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise translate(exc, self.endpoint, "KV collective open") from None
        if reply.error:
            raise HandshakeError(reply.error)
        host = self.endpoint.rpartition(":")[0].strip("[]")
        try:
            self._group = make_pair_group(
                self.backend,
                RemoteStore(self, reply.group_key, self._timeout),
                CONSUMER,
                self._timeout,
                local_address_towards(host),
            )
        except (RuntimeError, OSError) as exc:
            raise KVTransferError(f"collective rendezvous with {self.endpoint} ({self.backend}) failed: {exc}") from exc
        self._key = reply.group_key
        logger.info("KV collective pair with %s ready (%s)", self.endpoint, self.backend)
        return self._group

    def pull(
        self,
        request_id: str,
        block_ids: Sequence[int],
        sink: ChunkSink,
        *,
        engine_id: str,
        timeout_s: float,
        lease_expiry: float = 0.0,
    ) -> int:
        request = self.pull_request(request_id, block_ids, engine_id)
        return self.control.call(lambda: self._pull_once(request, block_ids, sink, timeout_s, engine_id))

    def _pull_once(
        self, request: pb.PullRequest, block_ids: Sequence[int], sink: ChunkSink, timeout_s: float, engine_id: str
    ) -> int:
        request_id = request.request_id
        assert self._remote_layout is not None
        row_bytes = [spec.block_bytes for spec in self._remote_layout.layers]
        # A new session (the producer forgot ours) forgets the pair first: its group is gone there
        self.control.session()
        with self._pair_lock:
            group = self._ensure_group(engine_id)
            self._tag = self._tag % (1 << 30) + 1
            call = self._collective_pull(
                pb.CollectivePullRequest(pull=request, group_key=self._key, tag=self._tag),
                metadata=self.control.metadata("CollectivePull"),
                timeout=timeout_s,
            )
            try:
                announced = next(call, None)
                if announced is None:
                    raise KVTransferError(f"producer {self.endpoint} ended the pull unannounced")
                plan = chunk_plan(row_bytes, len(block_ids), announced.chunk_bytes)
                if len(plan) != announced.num_chunks:
                    raise KVTransferError(
                        f"producer {self.endpoint} announced {announced.num_chunks} chunks of "
                        f"{announced.chunk_bytes} bytes, this consumer plans {len(plan)}"
                    )
                received = recv_chunks(group, self.device, plan, self._tag, self._buffers, sink)
                done = next(call, None)
                if done is None or not done.done:
                    raise KVTransferError(f"producer {self.endpoint} ended the pull before saying it was done")
                if done.bytes_sent != received:
                    raise KVTransferError(f"producer {self.endpoint} sent {done.bytes_sent} bytes, received {received}")
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    self._group = None  # the producer dropped the pair: open a new one next time
                raise translate(exc, self.endpoint, f"KV collective pull of {request_id}") from None
            except RuntimeError as exc:  # send/recv failed or timed out: the pair is broken
                call.cancel()
                self._group = None
                raise KVTransferError(f"KV collective pull of {request_id} from {self.endpoint}: {exc}") from exc
            except BaseException:
                call.cancel()
                self._group = None  # recvs may still be posted: never reuse this group
                raise
        return self.check_total(request_id, block_ids, received)

    def close(self) -> None:
        self._group = None
        super().close()


class CollectiveTransport(Transport):
    name = "collective"

    def server_extension(self, producer: KVProducer, host: str) -> CollectiveExtension:
        return CollectiveExtension(producer, self.settings, host)

    def connect(self, endpoint: str) -> TransportClient:
        return CollectiveClient(endpoint, self.settings, self.device)
