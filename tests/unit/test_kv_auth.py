"""Authentication of the KV control channel over real sockets: challenge-response, replay,
sessions, limits before authentication, a server that cannot prove itself, and mutual TLS."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import torch

from pdcluster.errors import AuthenticationError, KVTransferError
from pdcluster.kv_transfer.auth import AUTH_METADATA_KEY, ClientAuth
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION
from pdcluster.kv_transfer.settings import KVTransferSettings, TLSSettings
from pdcluster.kv_transfer.staging import BlockScatterer
from pdcluster.kv_transfer.transports import create_transport
from pdcluster.kv_transfer.transports.rpc import CONTROL_LIMIT, SERVICE
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.support.tls import make_pki
from tests.unit.kv_fixtures import make_cache

SECRET = "auth-test-secret"


def serve(settings: KVTransferSettings):
    producer = KVProducer(make_cache(), "prefill-0", max_chunk_bytes=4096, lease_wait_s=0.2)
    producer.leases.add("req-1", [3, 4, 5], time.monotonic() + 600)
    return producer, create_transport("grpc", settings).serve(producer, "127.0.0.1", 0)


@pytest.fixture
def server():
    producer, server = serve(KVTransferSettings(secret=SECRET, max_chunk_bytes=4096))
    yield producer, server
    server.stop(0)


def pull(address: str, settings: KVTransferSettings, request_id: str = "req-1", blocks=(3, 4, 5)):
    consumer = make_cache(fill="zeros")
    client = create_transport("grpc", settings).connect(address)
    try:
        client.handshake(consumer.layout, "decode-0")
        scatterer = BlockScatterer(consumer, 4096)
        scatterer.begin(list(range(len(blocks))))
        client.pull(request_id, list(blocks), scatterer.write, engine_id="decode-0", timeout_s=10)
    finally:
        client.close()
    return consumer


def stub(channel: grpc.Channel, method: str, response=None):
    """A raw unary stub that sends bytes as given (no pdcluster code on the caller's side)."""
    return channel.unary_unary(f"/{SERVICE}/{method}", response_deserializer=response)


def open_session(channel: grpc.Channel, secret: str = SECRET):
    """The challenge-response by hand: (the Authenticate request bytes, its answer)."""
    nonce = pb.ChallengeResponse.FromString(stub(channel, "Challenge")(b"", timeout=5)).nonce
    client_nonce, proof = ClientAuth(secret).answer(nonce, "decode-0")
    request = pb.AuthenticateRequest(
        nonce=nonce, client_nonce=client_nonce, consumer_engine_id="decode-0", proof=proof
    ).SerializeToString()
    answer = pb.AuthenticateResponse.FromString(stub(channel, "Authenticate")(request, timeout=5))
    return request, ClientAuth(secret).session(nonce, client_nonce, answer.session, answer.server_proof, "test")


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_a_replayed_challenge_answer_is_refused(server):
    _, srv = server
    with grpc.insecure_channel(srv.address) as channel:
        request, _ = open_session(channel)
        code, details = code_of(lambda: stub(channel, "Authenticate")(request, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "replay" in details


def test_a_wrong_secret_gets_no_session(server):
    _, srv = server
    with grpc.insecure_channel(srv.address) as channel:
        code, details = code_of(lambda: open_session(channel, secret="not-the-secret"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not the cluster secret" in details


def test_replayed_or_misdirected_call_credentials_are_refused(server):
    producer, srv = server
    handshake = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, engine_id="decode-0").SerializeToString()
    with grpc.insecure_channel(srv.address) as channel:
        _, session = open_session(channel)
        token = session.token("Handshake")
        call = stub(channel, "Handshake", pb.HandshakeResponse.FromString)
        assert call(handshake, metadata=((AUTH_METADATA_KEY, token),), timeout=5).engine_id == "prefill-0"
        replayed = code_of(lambda: call(handshake, metadata=((AUTH_METADATA_KEY, token),), timeout=5))
        release = pb.ReleaseRequest(request_id="req-1").SerializeToString()
        misdirected = code_of(  # a Handshake's credentials presented on a Release
            lambda: stub(channel, "Release")(release, metadata=((AUTH_METADATA_KEY, session.token("Handshake")),))
        )
    assert replayed[0] == grpc.StatusCode.UNAUTHENTICATED and "replay" in replayed[1]
    assert misdirected[0] == grpc.StatusCode.UNAUTHENTICATED and "wrong KV call credentials" in misdirected[1]
    assert len(producer.leases) == 1  # nothing was released


def test_a_call_sequence_number_too_long_for_an_int_is_refused_as_malformed(server):
    """The session id travels in clear; a sequence number of more digits than int() takes
    (4300) was a ValueError: an UNKNOWN status and a traceback in the producer's log."""
    _, srv = server
    handshake = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, engine_id="decode-0").SerializeToString()
    with grpc.insecure_channel(srv.address) as channel:
        _, session = open_session(channel)
        session_id = session.token("Handshake").split(".")[0]
        token = f"{session_id}.{'9' * 4301}.x"
        call = stub(channel, "Handshake", pb.HandshakeResponse.FromString)
        code, details = code_of(lambda: call(handshake, metadata=((AUTH_METADATA_KEY, token),), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "malformed" in details


def test_requests_are_small_and_unparsed_until_authenticated(server):
    """The server takes no message over CONTROL_LIMIT; garbage without credentials is refused
    as unauthenticated, not parsed (the same garbage with a session is a parse error)."""
    _, srv = server
    garbage = b"\xff" * 1000
    with grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        pull = channel.unary_stream(f"/{SERVICE}/Pull")
        huge = code_of(lambda: list(pull(b"\0" * (CONTROL_LIMIT + 1), timeout=5)))
        unauthenticated = code_of(lambda: list(pull(garbage, timeout=5)))
        _, session = open_session(channel)
        parsed = code_of(lambda: list(pull(garbage, metadata=((AUTH_METADATA_KEY, session.token("Pull")),))))
    assert huge[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert unauthenticated[0] == grpc.StatusCode.UNAUTHENTICATED
    assert parsed[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_server_that_forgot_the_session_is_authenticated_again(server):
    """A restarted producer knows no session: the client opens a new one and the pull goes on."""
    producer, srv = server
    settings = KVTransferSettings(secret=SECRET, max_chunk_bytes=4096)
    consumer = make_cache(fill="zeros")
    client = create_transport("grpc", settings).connect(srv.address)
    try:
        client.handshake(consumer.layout, "decode-0")
        first = client.control.session()
        srv.auth._sessions.clear()  # what a restart does to the server's sessions
        scatterer = BlockScatterer(consumer, 4096)
        scatterer.begin([0, 1, 2])
        client.pull("req-1", [3, 4, 5], scatterer.write, engine_id="decode-0", timeout_s=10)
        assert client.control.session() is not first
    finally:
        client.close()
    assert torch.equal(consumer.tensors[0][[0, 1, 2]], producer.cache.tensors[0][[3, 4, 5]])


class _Impostor:
    """A gRPC server that does not hold the secret: it answers the challenge (with a made-up
    proof) and records every method, metadata value and request byte it receives."""

    def __init__(self):
        self.received: list[tuple[str, tuple, bytes]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def service(self, details):  # grpc.GenericRpcHandler
        method = details.method.rsplit("/", 1)[1]
        metadata = tuple(details.invocation_metadata)

        def answer(raw: bytes, context):
            self.received.append((method, metadata, raw))
            if method == "Challenge":
                return pb.ChallengeResponse(nonce=b"n" * 40).SerializeToString()
            return pb.AuthenticateResponse(session="forged", server_proof=b"\0" * 32).SerializeToString()

        return grpc.unary_unary_rpc_method_handler(answer)


def test_a_server_that_cannot_prove_the_secret_learns_nothing_and_gets_no_call():
    impostor = _Impostor()
    try:
        client = create_transport("grpc", KVTransferSettings(secret=SECRET)).connect(f"127.0.0.1:{impostor.port}")
        with pytest.raises(AuthenticationError, match="did not prove it holds the cluster secret"):
            client.handshake(make_cache().layout, "decode-0")
        client.close()
    finally:
        impostor.server.stop(0)
    assert [method for method, _, _ in impostor.received] == ["Challenge", "Authenticate"]
    for _, metadata, raw in impostor.received:
        assert SECRET.encode() not in raw
        assert not any(SECRET in str(value) for _, value in metadata)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    return make_pki(directory), make_pki(directory, name="other")


def test_tls_serves_a_tls_client_and_refuses_plaintext_and_foreign_certificates(pki):
    ours, foreign = pki
    tls = KVTransferSettings(secret=SECRET, max_chunk_bytes=4096, tls=TLSSettings(**ours))
    producer, srv = serve(tls)
    try:
        consumer = pull(srv.address, tls)
        assert torch.equal(consumer.tensors[1][[0, 1, 2]], producer.cache.tensors[1][[3, 4, 5]])
        plaintext = KVTransferSettings(secret=SECRET, connect_timeout_seconds=2)
        with pytest.raises(KVTransferError):
            pull(srv.address, plaintext)
        other_ca = KVTransferSettings(secret=SECRET, connect_timeout_seconds=2, tls=TLSSettings(**foreign))
        with pytest.raises(KVTransferError):
            pull(srv.address, other_ca)
    finally:
        srv.stop(0)
    assert len(producer.leases) == 1


def test_tls_files_that_are_missing_or_empty_are_config_errors(tmp_path):
    from pdcluster.errors import ConfigError

    (tmp_path / "empty.pem").write_text("")
    tls = TLSSettings(cert_file=str(tmp_path / "empty.pem"), key_file="k", ca_file="c")
    with pytest.raises(ConfigError, match="kv_transfer.tls.cert_file: .*is empty"):
        tls.read()
    with pytest.raises(ConfigError, match="kv_transfer.tls.key_file"):
        tls.model_copy(update={"cert_file": __file__}).read()
