"""gRPC backend: portable KV handoff between any two hosts.

Server: a grpc thread-pool server in the producer's model-runner process, bound to the configured
address. Every call but the two that open a session must prove its session (rpc.py, auth.py); a
peer without one gets UNAUTHENTICATED, its request unparsed, and no bytes. `Pull` streams
`KVChunk` messages encoded by `wire.py` straight from the staging slots (the generated
serializer is bypassed for this one message; its bytes are still the protobuf encoding).

Client: one channel per producer endpoint, reused across pulls, and one session on it; chunks are
decoded to zero-copy views and handed to the sink, which writes them into the local cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager

import grpc
import grpc.experimental

from pdcluster.errors import HandshakeError, KVTransferError, LeaseNotFoundError, PortTakenError
from pdcluster.kv_transfer.auth import ServerAuth, ServerSession
from pdcluster.kv_transfer.kv_cache import Chunk
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import (
    PROTOCOL_VERSION,
    KVLayout,
    LayerSpec,
    ProducerInfo,
    check_protocol_version,
    compare_layouts,
    layout_digest,
)
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import rpc
from pdcluster.kv_transfer.transports.base import (
    ChunkSink,
    ServerExtension,
    Transport,
    TransportClient,
    TransportServer,
)
from pdcluster.kv_transfer.transports.rpc import SERVICE, ControlChannel, translate
from pdcluster.kv_transfer.wire import ChunkHeader, allocate_chunk, decode_chunk
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

__all__ = ["SERVICE", "GrpcClient", "GrpcServer", "pull_errors_abort", "stream_pull", "translate"]


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        model=layout.model,
        block_size=layout.block_size,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        layers=[pb.LayerSpec(name=s.name, block_shape=list(s.block_shape), dtype=s.dtype) for s in layout.layers],
    )


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(
        model=msg.model,
        block_size=msg.block_size,
        tp_size=msg.tp_size,
        tp_rank=msg.tp_rank,
        layers=tuple(LayerSpec(name=s.name, block_shape=tuple(s.block_shape), dtype=s.dtype) for s in msg.layers),
    )


def stream_pull(producer: KVProducer, request: pb.PullRequest, into):
    """The producer's chunk stream for a PullRequest (every backend's server reads through it)."""
    return producer.stream(
        request.request_id,
        list(request.block_ids),
        remote_version=request.protocol_version,
        remote_digest=request.layout_digest,
        max_chunk_bytes=request.max_chunk_bytes,
        into=into,
    )


@contextmanager
def pull_errors_abort(context: grpc.ServicerContext) -> Iterator[None]:
    """End a serving call with the status the client maps back to the producer's error."""
    try:
        yield
    except LeaseNotFoundError as exc:
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except HandshakeError as exc:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


class _Servicer:
    def __init__(self, producer: KVProducer, offers: Sequence[str], threads: int):
        from pdcluster.kv_transfer.transports.selection import node_id

        self.producer = producer
        # Held lease lookups (one per consumer waiting on this producer) may take half the
        # server's threads; pulls, releases and renewals always find one.
        self.max_held = max(1, threads // 2)
        self.lookups_held = 0
        self._lock = threading.Lock()
        self._node_id = node_id()
        self._offers = list(offers)
        self.handshake_fields: dict[str, str] = {}  # what extensions add (shm: its socket)

    def handshake(self, request: pb.HandshakeRequest, session: ServerSession, context) -> pb.HandshakeResponse:
        error = ""
        try:
            self.producer.handshake(request.protocol_version, layout_from_pb(request.layout))
        except HandshakeError as exc:
            error = str(exc)
            logger.error("handshake from %s refused: %s", request.engine_id, error)
        return pb.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.producer.engine_id,
            layout=layout_to_pb(self.producer.layout),
            error=error,
            node_id=self._node_id,
            device_kind=self.producer.cache.device.type,
            offers=self._offers,
            **self.handshake_fields,
        )

    def pull(self, request: pb.PullRequest, session: ServerSession, context):
        messages: list[bytes] = []

        def into(chunk: Chunk) -> memoryview:
            # Blocks are gathered straight into the serialized KVChunk (wire.allocate_chunk).
            header = ChunkHeader(chunk.layer_index, chunk.first, chunk.count)
            message, payload = allocate_chunk(header, chunk.nbytes)
            messages.append(message)
            return payload

        with pull_errors_abort(context):
            for _ in stream_pull(self.producer, request, into):
                yield messages.pop()

    def release(self, request: pb.ReleaseRequest, session: ServerSession, context) -> pb.ReleaseResponse:
        released = self.producer.release(request.request_id, request.transferred)
        return pb.ReleaseResponse(released=released)

    def renew(self, request: pb.RenewRequest, session: ServerSession, context) -> pb.RenewResponse:
        return pb.RenewResponse(renewed=self.producer.renew(list(request.request_ids)))

    def handouts(self, request: pb.HandoutsRequest, session: ServerSession, context) -> pb.HandoutsResponse:
        """Lease lookup by key. A held lookup takes one of the server's threads until a lease comes,
        its hold ends or the consumer cancels it (its thread is then free at once); at most
        `max_held` are held at a time, and a lookup past that is answered at once."""
        with self._lock:
            held = self.lookups_held < self.max_held
            self.lookups_held += held
        stop = threading.Event()

        def free_slot() -> None:  # once, from whichever comes first: the RPC's end or the answer
            nonlocal held
            with self._lock:
                self.lookups_held -= held
                held = False

        def ended() -> None:
            # gRPC runs this on its polling thread when the cancel reaches the server (the thread
            # that also hands out new calls): a consumer's call asked again right after its
            # cancel finds the slot free, though the cancelled call's thread may not have
            # returned yet (it would be answered at once, unheld, and asked a third time).
            self.producer.end_hold(stop)
            free_slot()

        try:
            if held:
                context.add_callback(ended)
            found = self.producer.handouts(list(request.keys), request.wait_ms / 1000 if held else 0.0, stop)
        finally:
            stop.set()  # answered: the RPC's end (its callback) has no waiting lookup to wake
            free_slot()
        return pb.HandoutsResponse(
            handouts=[
                pb.Handout(key=key, params_json=params, first_token=token) for key, (params, token) in found.items()
            ]
        )


class GrpcServer(TransportServer):
    """The producer's control server: the gRPC pull, plus each extension's RPCs."""

    def __init__(
        self,
        producer: KVProducer,
        host: str,
        port: int,
        settings: KVTransferSettings,
        extensions: Sequence[ServerExtension] = (),
        offers: Sequence[str] = ("grpc",),
    ):
        servicer = self._servicer = _Servicer(producer, offers, settings.server_threads)
        self._extensions = list(extensions)
        auth = self.auth = ServerAuth(settings.secret_value())
        authorize = self.authorizer = rpc.Authorizer(auth, settings.server_threads)
        handlers = {
            **rpc.session_handlers(auth, authorize),
            "Handshake": rpc.unary_unary(
                authorize, "Handshake", pb.HandshakeRequest, pb.HandshakeResponse, servicer.handshake
            ),
            # The chunks are already the KVChunk encoding (wire.py): no serializer.
            "Pull": rpc.unary_stream(authorize, "Pull", pb.PullRequest, servicer.pull, None),
            "Release": rpc.unary_unary(authorize, "Release", pb.ReleaseRequest, pb.ReleaseResponse, servicer.release),
            "Renew": rpc.unary_unary(authorize, "Renew", pb.RenewRequest, pb.RenewResponse, servicer.renew),
            "Handouts": rpc.unary_unary(
                authorize, "Handouts", pb.HandoutsRequest, pb.HandoutsResponse, servicer.handouts
            ),
        }
        for extension in self._extensions:
            handlers.update(extension.handlers(authorize))
            servicer.handshake_fields.update(extension.handshake_fields())
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.server_threads, thread_name_prefix="kv-grpc"),
            options=rpc.server_options(settings),
        )
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            bound = rpc.bind(self._server, f"{host}:{port}", settings)
        except RuntimeError as exc:
            self.close_extensions()
            raise PortTakenError(f"cannot bind KV server to {host}:{port}: {exc}") from exc
        if bound == 0:
            self.close_extensions()
            raise PortTakenError(f"cannot bind KV server to {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()
        logger.info("KV gRPC server for engine %s on %s", producer.engine_id, self._address)

    @property
    def address(self) -> str:
        return self._address

    @property
    def lookups_held(self) -> int:
        """Lease lookups this server holds now (each on one of its threads)."""
        return self._servicer.lookups_held

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()
        self.close_extensions()

    def close_extensions(self) -> None:
        for extension in self._extensions:
            extension.close()
        self._extensions.clear()


class GrpcClient(TransportClient):
    def __init__(self, endpoint: str, settings: KVTransferSettings):
        self.endpoint = endpoint
        self.settings = settings
        self.control = ControlChannel(endpoint, settings)
        self.channel = self.control.channel
        self._handshake = self.control.stub("Handshake", pb.HandshakeRequest, pb.HandshakeResponse)
        self._pull = self.control.stub("Pull", pb.PullRequest, decode_chunk, kind="unary_stream")
        self._release = self.control.stub("Release", pb.ReleaseRequest, pb.ReleaseResponse)
        self._renew = self.control.stub("Renew", pb.RenewRequest, pb.RenewResponse)
        self._handouts = self.control.stub("Handouts", pb.HandoutsRequest, pb.HandoutsResponse)
        self._digest: int | None = None
        self._remote_layout: KVLayout | None = None
        self.shm_socket = ""  # the producer's, from the handshake (shm's direct variant)
        self.handshake_reply: pb.HandshakeResponse | None = None

    def handshake(self, local_layout: KVLayout, engine_id: str) -> ProducerInfo:
        request = pb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, engine_id=engine_id, layout=layout_to_pb(local_layout)
        )
        self.control.engine_id = engine_id

        def call() -> pb.HandshakeResponse:
            try:
                return self._handshake(
                    request,
                    metadata=self.control.metadata("Handshake"),
                    timeout=self.settings.connect_timeout_seconds,
                    wait_for_ready=True,
                )
            except grpc.RpcError as exc:
                raise translate(exc, self.endpoint, "KV handshake") from None

        reply = self.control.call(call)
        if reply.error:
            raise HandshakeError(reply.error)
        check_protocol_version(reply.protocol_version, remote_role="prefill (producer)")
        remote = layout_from_pb(reply.layout)
        compare_layouts(local_layout, remote, local_role="decode (consumer)", remote_role="prefill (producer)")
        self._digest = layout_digest(local_layout)
        self._remote_layout = remote
        self.shm_socket = reply.shm_socket
        self.handshake_reply = reply  # what backends read of the producer (mooncake: its regions)
        return ProducerInfo(
            engine_id=reply.engine_id,
            layout=remote,
            node_id=reply.node_id,
            device_kind=reply.device_kind,
            # A producer from before these fields offers what every producer serves: grpc.
            offers=tuple(reply.offers) or ("grpc",),
        )

    def pull_request(self, request_id: str, block_ids: Sequence[int], engine_id: str) -> pb.PullRequest:
        """The PullRequest every backend sends (raises before a successful handshake)."""
        if self._digest is None or self._remote_layout is None:
            raise KVTransferError(f"pull from {self.endpoint} before a successful handshake")
        return pb.PullRequest(
            protocol_version=PROTOCOL_VERSION,
            request_id=request_id,
            block_ids=list(block_ids),
            consumer_engine_id=engine_id,
            max_chunk_bytes=self.settings.max_chunk_bytes,
            layout_digest=self._digest,
        )

    def check_chunk(self, header: ChunkHeader, num_blocks: int) -> Chunk:
        """The chunk a producer's header announces, refused unless it fits the pull."""
        assert self._remote_layout is not None
        layers = self._remote_layout.layers
        if header.layer_index >= len(layers) or header.first_block + header.num_blocks > num_blocks:
            raise KVTransferError(f"malformed KV chunk {header} from {self.endpoint}")
        nbytes = header.num_blocks * layers[header.layer_index].block_bytes
        return Chunk(header.layer_index, header.first_block, header.num_blocks, nbytes)

    def check_total(self, request_id: str, block_ids: Sequence[int], received: int) -> int:
        assert self._remote_layout is not None
        expected = len(block_ids) * self._remote_layout.bytes_per_block()
        if received != expected:
            raise KVTransferError(
                f"KV pull of {request_id} from {self.endpoint} ended after {received} of {expected} bytes"
            )
        return received

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
        return self.control.call(lambda: self._pull_once(request, block_ids, sink, timeout_s))

    def _pull_once(self, request: pb.PullRequest, block_ids: Sequence[int], sink: ChunkSink, timeout_s: float) -> int:
        request_id = request.request_id
        received = 0
        call = self._pull(request, metadata=self.control.metadata("Pull"), timeout=timeout_s)
        try:
            for header, data in call:
                chunk = self.check_chunk(header, len(block_ids))
                if len(data) != chunk.nbytes:
                    raise KVTransferError(
                        f"KV chunk {header} from {self.endpoint} has {len(data)} bytes, expected {chunk.nbytes}"
                    )
                sink(chunk, data)
                received += chunk.nbytes
        except grpc.RpcError as exc:
            raise translate(exc, self.endpoint, f"KV pull of {request_id}") from None
        except BaseException:
            call.cancel()
            raise
        return self.check_total(request_id, block_ids, received)

    def release(self, request_id: str, *, transferred: bool, engine_id: str, timeout_s: float) -> bool:
        request = pb.ReleaseRequest(request_id=request_id, transferred=transferred, consumer_engine_id=engine_id)

        def call() -> bool:
            try:
                return self._release(request, metadata=self.control.metadata("Release"), timeout=timeout_s).released
            except grpc.RpcError as exc:
                raise translate(exc, self.endpoint, f"KV release of {request_id}") from None

        return self.control.call(call)

    def renew(self, request_ids: Sequence[str], *, engine_id: str, timeout_s: float) -> int:
        """Keep the leases of requests this consumer holds queued; how many the producer had."""
        request = pb.RenewRequest(request_ids=list(request_ids), consumer_engine_id=engine_id)

        def call() -> int:
            try:
                return self._renew(request, metadata=self.control.metadata("Renew"), timeout=timeout_s).renewed
            except grpc.RpcError as exc:
                raise translate(exc, self.endpoint, "KV lease renewal") from None

        return self.control.call(call)

    def handouts(
        self,
        keys: Sequence[str],
        *,
        engine_id: str,
        wait_s: float,
        timeout_s: float,
        interrupt: threading.Event | None = None,
    ) -> dict[str, tuple[str, int]] | None:
        """key -> (signed lease as JSON, first token) of the keys whose lease the producer has
        registered; it holds the call up to wait_s while it has none of them. `interrupt` set
        (also before the call): the call is cancelled, freeing the producer's thread, and
        answers None (this consumer has other keys to ask for); the event is also set when the
        call ends by itself (not when cancelled)."""
        request = pb.HandoutsRequest(keys=list(keys), consumer_engine_id=engine_id, wait_ms=int(wait_s * 1000))

        def call() -> dict[str, tuple[str, int]] | None:
            try:
                metadata, timeout = self.control.metadata("Handouts"), timeout_s + wait_s
                if interrupt is None:
                    reply = self._handouts(request, metadata=metadata, timeout=timeout)
                else:
                    future = self._handouts.future(request, metadata=metadata, timeout=timeout)
                    # Not for a call we cancelled: gRPC reports its end later, on its own thread,
                    # when the caller may have cleared `interrupt` for its next call already.
                    future.add_done_callback(lambda f: f.cancelled() or interrupt.set())
                    interrupt.wait()
                    if future.cancel():
                        return None
                    reply = future.result()
            except grpc.RpcError as exc:
                raise translate(exc, self.endpoint, "KV lease lookup") from None
            return {h.key: (h.params_json, h.first_token) for h in reply.handouts}

        return self.control.call(call)

    def close(self) -> None:
        self.control.close()


class GrpcTransport(Transport):
    name = "grpc"

    def serve(self, producer: KVProducer, host: str, port: int) -> TransportServer:
        return GrpcServer(producer, host, port, self.settings)

    def connect(self, endpoint: str) -> TransportClient:
        return GrpcClient(endpoint, self.settings)
