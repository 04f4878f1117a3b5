"""Authentication of the KV control channel: challenge-response, then per-call MACs.

No secret travels. A consumer opens a session on a producer's KV server in two calls:
  Challenge     the server hands out a nonce (stateless: random bytes, the time it was issued
                and a MAC under a key only this server process knows, so unauthenticated callers
                cost it no memory);
  Authenticate  the consumer answers HMAC(K, nonce, client nonce, its engine id); the server
                checks it, refuses a nonce that is stale or was used before (replay), and answers
                a session id with its own proof, HMAC(K, ..., session id): the consumer talks on
                only to a server that holds the cluster secret too (mutual).
Both sides derive the session key from K and the two nonces. Every later call carries, in the
`x-pdcluster-kv-auth` metadata, `session.seq.mac` with mac = HMAC(session key, session, seq,
method); the server accepts each seq of a session once (a sliding window: calls of one session
run concurrently and may arrive out of order). K is derived from the cluster secret
(keys.KV_AUTH). Integrity of the messages themselves against an active man in the middle is
what `kv_transfer.tls` adds; this layer makes sure only cluster members are served.

Free of gRPC: transports/rpc.py wires it into the server's handlers and the clients' calls.
"""

from __future__ import annotations

import hmac
import itertools
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdcluster.errors import AuthenticationError
from pdcluster.keys import KV_AUTH, derive_key, mac

AUTH_METADATA_KEY = "x-pdcluster-kv-auth"
NONCE_TTL_S = 30.0  # an answer to a challenge must come within this
MAX_SESSIONS = 4096  # oldest (least recently used) sessions are forgotten beyond this
REPLAY_WINDOW = 4096  # seqs of a session remembered; older ones are refused
STALE_SESSION = "unknown KV session"  # the server forgot it (restart, eviction): open a new one

_NONCE_RANDOM = 16
_NONCE_BYTES = _NONCE_RANDOM + 8 + 16


class AuthRefused(Exception):
    """A call or an answer that does not authenticate; `stale`: its session is unknown here."""

    def __init__(self, message: str, *, stale: bool = False):
        super().__init__(message)
        self.stale = stale


def _client_proof(key: bytes, nonce: bytes, client_nonce: bytes, consumer: str) -> bytes:
    return mac(key, "pdcluster-kv-client", nonce, client_nonce, consumer)


def _server_proof(key: bytes, nonce: bytes, client_nonce: bytes, session: str) -> bytes:
    return mac(key, "pdcluster-kv-server", nonce, client_nonce, session)


def _session_key(key: bytes, nonce: bytes, client_nonce: bytes) -> bytes:
    return mac(key, "pdcluster-kv-session", nonce, client_nonce)


def _call_mac(session_key: bytes, session: str, seq: int, method: str) -> str:
    return mac(session_key, "pdcluster-kv-call", session, str(seq), method).hex()


@dataclass
class ServerSession:
    """One consumer's session on this server."""

    id: str
    key: bytes
    consumer: str  # the engine id it authenticated with
    _floor: int = 0  # every seq <= floor is refused
    _seen: set[int] = field(default_factory=set)

    def accept(self, seq: int) -> bool:
        """True the first time `seq` is presented (within the window)."""
        if seq <= self._floor or seq in self._seen:
            return False
        self._seen.add(seq)
        if len(self._seen) > REPLAY_WINDOW:
            ordered = sorted(self._seen)
            drop = ordered[: len(ordered) // 2]
            self._floor = drop[-1]
            self._seen.difference_update(drop)
        return True


class ServerAuth:
    """The server side: challenges, sessions and the check of every call."""

    def __init__(self, secret: str):
        self._key = derive_key(secret, KV_AUTH)
        self._nonce_key = os.urandom(32)  # this process only: a restart voids old challenges
        self._used: dict[bytes, float] = {}  # answered nonces, until they would be stale anyway
        self._sessions: OrderedDict[str, ServerSession] = OrderedDict()
        self._lock = threading.Lock()

    def challenge(self) -> bytes:
        random = os.urandom(_NONCE_RANDOM)
        issued = time.monotonic_ns().to_bytes(8, "big")
        return random + issued + mac(self._nonce_key, "pdcluster-kv-nonce", random, issued)[:16]

    def authenticate(self, nonce: bytes, client_nonce: bytes, consumer: str, proof: bytes) -> tuple[str, bytes]:
        """A new session for a correct answer: (session id, the server's proof)."""
        if len(nonce) != _NONCE_BYTES or not 16 <= len(client_nonce) <= 64:
            raise AuthRefused("malformed challenge answer")
        random, issued = nonce[:_NONCE_RANDOM], nonce[_NONCE_RANDOM:-16]
        if not hmac.compare_digest(nonce[-16:], mac(self._nonce_key, "pdcluster-kv-nonce", random, issued)[:16]):
            raise AuthRefused("challenge not issued by this server")
        now = time.monotonic()
        if now - int.from_bytes(issued, "big") / 1e9 > NONCE_TTL_S:
            raise AuthRefused("challenge expired")
        if not hmac.compare_digest(proof, _client_proof(self._key, nonce, client_nonce, consumer)):
            raise AuthRefused("wrong challenge answer (not the cluster secret)")
        session_id = secrets.token_hex(16)
        with self._lock:
            for old in [n for n, t in self._used.items() if now - t > NONCE_TTL_S]:
                del self._used[old]
            if nonce in self._used:
                raise AuthRefused("challenge answered before (replay)")
            self._used[nonce] = now
            self._sessions[session_id] = ServerSession(
                session_id, _session_key(self._key, nonce, client_nonce), consumer
            )
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return session_id, _server_proof(self._key, nonce, client_nonce, session_id)

    def verify(self, token: str, method: str) -> ServerSession:
        """The session a call's `session.seq.mac` token proves, for `method`."""
        session_id, _, rest = token.partition(".")
        seq_text, _, presented = rest.partition(".")
        # A client counts its calls from 0: 19 digits outlast any session (and int() takes no
        # more than 4300: a longer one raised past this check).
        if not (session_id and seq_text.isascii() and seq_text.isdigit() and len(seq_text) <= 19 and presented):
            raise AuthRefused("missing or malformed KV credentials")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise AuthRefused(STALE_SESSION, stale=True)
            seq = int(seq_text)
            if not hmac.compare_digest(presented, _call_mac(session.key, session_id, seq, method)):
                raise AuthRefused("wrong KV call credentials")
            if not session.accept(seq):
                raise AuthRefused("KV call credentials used before (replay)")
            self._sessions.move_to_end(session_id)
            return session


class ClientSession:
    """A consumer's session on one server: a token per call."""

    def __init__(self, session_id: str, key: bytes):
        self.id = session_id
        self._key = key
        self._seq = itertools.count(1)  # next() is atomic: calls from several threads are fine

    def token(self, method: str) -> str:
        seq = next(self._seq)
        return f"{self.id}.{seq}.{_call_mac(self._key, self.id, seq, method)}"


class ClientAuth:
    """The consumer side of the challenge-response."""

    def __init__(self, secret: str):
        self._key = derive_key(secret, KV_AUTH)

    def answer(self, nonce: bytes, consumer: str) -> tuple[bytes, bytes]:
        """(client nonce, proof) for a server's challenge."""
        client_nonce = os.urandom(16)
        return client_nonce, _client_proof(self._key, nonce, client_nonce, consumer)

    def session(
        self, nonce: bytes, client_nonce: bytes, session_id: str, server_proof: bytes, endpoint: str
    ) -> ClientSession:
        """The session, once the server proved it holds the cluster secret too."""
        expected = _server_proof(self._key, nonce, client_nonce, session_id)
        if not session_id or not hmac.compare_digest(server_proof, expected):
            raise AuthenticationError(
                f"KV server {endpoint} did not prove it holds the cluster secret: not dialing it again"
            )
        return ClientSession(session_id, _session_key(self._key, nonce, client_nonce))
