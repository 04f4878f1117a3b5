"""The KV control channel's gRPC plumbing, shared by every backend: authenticated handlers on
the producer's server, authenticated calls from the consumer's clients, and TLS.

Server: every handler is built by `unary_unary`/`unary_stream`/`stream_stream` here. gRPC hands
it the raw request bytes (no deserializer); the handler checks the call's credentials
(auth.ServerAuth) and only then parses them. The server's receive limit is `CONTROL_LIMIT`:
it only ever receives control messages. A refusal aborts with UNAUTHENTICATED and is logged once
per peer host and reason. The authorizer also counts the calls in progress by method: when they
take every one of the server's threads (the next calls wait), it says which (at most every
`BUSY_WARNING_INTERVAL_S`).

Client: `ControlChannel` owns the channel (TLS when configured) and the session; `metadata(m)`
is what a call of method `m` carries. A server that forgot the session (restart) answers
STALE_SESSION before doing anything, so `call` opens a new session and retries once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from pdcluster.errors import (
    AuthenticationError,
    HandshakeError,
    KVTransferError,
    LeaseNotFoundError,
    TransferTimeoutError,
)
from pdcluster.kv_transfer.auth import (
    AUTH_METADATA_KEY,
    STALE_SESSION,
    AuthRefused,
    ClientAuth,
    ClientSession,
    ServerAuth,
    ServerSession,
)
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports.base import Authorize
from pdcluster.logs import WarnOnce
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = "pdcluster.kv.v3.KVTransfer"
CONTROL_LIMIT = 1 << 20  # what a KV server accepts in one message (control only; KV flows out)
BULK_LIMIT = 256 << 20  # what a KV client accepts from the server it authenticated
BUSY_WARNING_INTERVAL_S = 10.0
T = TypeVar("T")


def server_options(settings: KVTransferSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", CONTROL_LIMIT),
        ("grpc.max_send_message_length", max(BULK_LIMIT, settings.max_chunk_bytes * 2)),
        *_bulk_tuning(),
        ("grpc.so_reuseport", 0),
    ]


def client_options(settings: KVTransferSettings) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max(BULK_LIMIT, settings.max_chunk_bytes * 2)),
        ("grpc.max_send_message_length", CONTROL_LIMIT),
        *_bulk_tuning(),
    ]
    if settings.tls is not None and settings.tls.server_name:
        options.append(("grpc.ssl_target_name_override", settings.tls.server_name))
    return options


def _bulk_tuning() -> list[tuple[str, int]]:
    # Bulk transfer tuning (bench/kv_transfer.py): fewer, larger HTTP/2 frames and writes.
    return [("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1), ("grpc.http2.write_buffer_size", 64 * 1024 * 1024)]


def bind(server: grpc.Server, address: str, settings: KVTransferSettings) -> int:
    """Listen on address (mutual TLS when configured); the port bound, 0 on failure."""
    if settings.tls is None:
        return server.add_insecure_port(address)
    chain, key, ca = settings.tls.read()
    credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(address, credentials)


def open_channel(endpoint: str, settings: KVTransferSettings) -> grpc.Channel:
    if settings.tls is None:
        return grpc.insecure_channel(endpoint, options=client_options(settings))
    chain, key, ca = settings.tls.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    return grpc.secure_channel(endpoint, credentials, options=client_options(settings))


# -- server ------------------------------------------------------------------------------------


class Authorizer:
    """Checks each call's credentials against the server's sessions; aborts the call otherwise."""

    def __init__(self, auth: ServerAuth, threads: int = 0):
        self.auth = auth
        self._warn = WarnOnce(logger)
        self.threads = threads  # the server's (0: not known)
        self.busy: Counter[str] = Counter()  # authenticated calls in progress, by method
        self._busy_lock = threading.Lock()
        self._last_busy_warning = float("-inf")

    def __call__(self, context: grpc.ServicerContext, method: str) -> ServerSession:
        token = ""
        for key, value in context.invocation_metadata():
            if key == AUTH_METADATA_KEY:
                token = value if isinstance(value, str) else value.decode(errors="replace")
        try:
            session = self.auth.verify(token, method)
        except AuthRefused as exc:
            self.refuse(context, str(exc))
            raise  # abort raised already; for type checkers
        self._enter(context, method)
        return session

    def _enter(self, context: grpc.ServicerContext, method: str) -> None:
        """Count the call until it ends; say so when the calls in progress take every thread."""
        now = time.monotonic()
        with self._busy_lock:
            self.busy[method] += 1
            full = 0 < self.threads <= sum(self.busy.values())
            warn = full and now - self._last_busy_warning >= BUSY_WARNING_INTERVAL_S
            if warn:
                self._last_busy_warning = now
                calls = ", ".join(f"{m} {n}" for m, n in sorted(self.busy.items()) if n)
        if not context.add_callback(functools.partial(self._leave, method)):
            self._leave(method)  # the call ended already
        if warn:
            logger.warning(
                "KV server: calls in progress take all %d of its threads (%s); others wait", self.threads, calls
            )

    def _leave(self, method: str) -> None:
        with self._busy_lock:
            self.busy[method] -= 1

    def refuse(self, context: grpc.ServicerContext, reason: str) -> None:
        host = context.peer().rpartition(":")[0]
        self._warn((host, reason), "refused KV call from %s: %s", host, reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)


def parse(message_type: type[T], raw: bytes, context: grpc.ServicerContext) -> T:
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message_type.__name__}: {exc}")
        raise


def unary_unary(authorize: Authorize, method: str, request_type, response_type, fn) -> grpc.RpcMethodHandler:
    """fn(request, session, context) -> response, after the call authenticated."""

    def handler(raw: bytes, context):
        session = authorize(context, method)
        return fn(parse(request_type, raw, context), session, context)

    return grpc.unary_unary_rpc_method_handler(handler, response_serializer=response_type.SerializeToString)


def unary_stream(authorize: Authorize, method: str, request_type, fn, response_serializer) -> grpc.RpcMethodHandler:
    """fn(request, session, context) -> iterator of responses, after the call authenticated."""

    def handler(raw: bytes, context):
        session = authorize(context, method)
        yield from fn(parse(request_type, raw, context), session, context)

    return grpc.unary_stream_rpc_method_handler(handler, response_serializer=response_serializer)


def stream_stream(authorize: Authorize, method: str, request_type, response_type, fn) -> grpc.RpcMethodHandler:
    """fn(requests, session, context) -> iterator of responses; requests parse lazily, each
    after the call authenticated."""

    def handler(raws: Iterator[bytes], context):
        session = authorize(context, method)
        yield from fn((parse(request_type, raw, context) for raw in raws), session, context)

    return grpc.stream_stream_rpc_method_handler(handler, response_serializer=response_type.SerializeToString)


def session_handlers(auth: ServerAuth, authorizer: Authorizer) -> dict[str, grpc.RpcMethodHandler]:
    """Challenge and Authenticate: the only calls served without a session."""

    def challenge(raw: bytes, context) -> pb.ChallengeResponse:
        return pb.ChallengeResponse(nonce=auth.challenge())

    def authenticate(raw: bytes, context) -> pb.AuthenticateResponse:
        request = parse(pb.AuthenticateRequest, raw, context)
        try:
            session, proof = auth.authenticate(
                request.nonce, request.client_nonce, request.consumer_engine_id, request.proof
            )
        except AuthRefused as exc:
            authorizer.refuse(context, str(exc))
            raise
        return pb.AuthenticateResponse(session=session, server_proof=proof)

    return {
        "Challenge": grpc.unary_unary_rpc_method_handler(
            challenge, response_serializer=pb.ChallengeResponse.SerializeToString
        ),
        "Authenticate": grpc.unary_unary_rpc_method_handler(
            authenticate, response_serializer=pb.AuthenticateResponse.SerializeToString
        ),
    }


# -- client ------------------------------------------------------------------------------------


class StaleSessionError(AuthenticationError):
    """The server no longer knows our session (it restarted): open a new one and retry."""


class ControlChannel:
    """A consumer's channel to one producer's KV server, and its session there."""

    def __init__(self, endpoint: str, settings: KVTransferSettings):
        self.endpoint = endpoint
        self.settings = settings
        self.channel = open_channel(endpoint, settings)
        self.engine_id = ""  # the consumer's, set by the first handshake
        self._auth = ClientAuth(settings.secret_value())
        self._session: ClientSession | None = None
        self._lock = threading.Lock()
        self._challenge = self.stub("Challenge", pb.ChallengeRequest, pb.ChallengeResponse)
        self._authenticate = self.stub("Authenticate", pb.AuthenticateRequest, pb.AuthenticateResponse)
        self.on_new_session: list[Callable[[], None]] = []  # backends drop per-session state

    def stub(self, method: str, request_type, response, kind: str = "unary_unary") -> Callable[..., Any]:
        """The callable for one method of our service on this channel. `response`: the reply's
        protobuf type, or a function of the reply's bytes; `kind`: unary_unary, unary_stream or
        stream_stream (grpc.Channel's own names)."""
        deserialize = response.FromString if isinstance(response, type) else response
        return getattr(self.channel, kind)(
            f"/{SERVICE}/{method}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=deserialize,
        )

    def session(self) -> ClientSession:
        with self._lock:
            if self._session is None:
                self._session = self._open()
                for hook in self.on_new_session:
                    hook()
            return self._session

    def _open(self) -> ClientSession:
        timeout = self.settings.connect_timeout_seconds
        try:
            nonce = self._challenge(
                pb.ChallengeRequest(consumer_engine_id=self.engine_id), timeout=timeout, wait_for_ready=True
            ).nonce
            client_nonce, proof = self._auth.answer(nonce, self.engine_id)
            reply = self._authenticate(
                pb.AuthenticateRequest(
                    nonce=nonce, client_nonce=client_nonce, consumer_engine_id=self.engine_id, proof=proof
                ),
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            raise translate(exc, self.endpoint, "KV authentication") from None
        return self._auth.session(nonce, client_nonce, reply.session, reply.server_proof, self.endpoint)

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        return ((AUTH_METADATA_KEY, self.session().token(method)),)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn (which makes authenticated calls); once more on a new session if the server
        had forgotten ours."""
        try:
            return fn()
        except StaleSessionError:
            with self._lock:
                self._session = None
            logger.info("KV server %s forgot our session (restarted?): authenticating again", self.endpoint)
            return fn()

    def close(self) -> None:
        self.channel.close()


_STATUS_ERRORS: dict[grpc.StatusCode, type[KVTransferError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: LeaseNotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: HandshakeError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeoutError,
}


def translate(exc: grpc.RpcError, endpoint: str, what: str) -> KVTransferError:
    """The pdcluster error a failed call means (StaleSessionError: retry on a new session)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    cls = _STATUS_ERRORS.get(code, KVTransferError)
    if code == grpc.StatusCode.UNAUTHENTICATED and details == STALE_SESSION:
        cls = StaleSessionError
    return cls(f"{what} on {endpoint} failed ({code.name}): {details}")
