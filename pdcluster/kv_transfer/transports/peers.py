"""Which local process a direct shm consumer is, proven by the kernel, and what it registered.

The shm backend's direct variant has the producer write KV into the consumer's memory
(process_vm_writev). It must write only into the process that asked, and only into the cache
that process registered. The proof: the producer listens on an abstract Unix socket (named in
the handshake); a consumer connects, and the kernel tells the producer the connecting process's
pid and uid (SO_PEERCRED), which no peer can forge. The producer answers a random token bound to
that pid and keeps the connection; the consumer then registers its cache regions with the token
over its authenticated gRPC session (ShmRegister). A registration belongs to that session, ends
when the connection closes (the consumer exited) and holds a pidfd of the process, taken as it
connected, so a write never goes to a process that exited (nor to one that reused its pid).

Anything else (an unknown token or registration, another pid, blocks outside the regions, a
process of another user) is refused and logged once.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.logs import WarnOnce
from pdcluster.pidfds import exited

logger = logging.getLogger(__name__)

MAX_PEERS = 256
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+: a pidfd of the connected process


class PeerRefused(Exception):
    pass


@dataclass
class Registration:
    id: str
    token: str  # of the peer connection it was proven on
    session: str  # the gRPC session that registered it
    pid: int
    pidfd: int
    regions: tuple[tuple[int, int, int], ...]  # per layer: (address, bytes, bytes per block)
    # A push thread asks alive() while the registry's thread may end the registration: the pidfd
    # is closed only under this lock, and never polled once closed (its number may be reused).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _ended: bool = field(default=False, repr=False, compare=False)

    def alive(self) -> bool:
        """False once the registered process exited (its pidfd became readable) or the
        registration ended (its connection closed, or the registry)."""
        with self._lock:
            return not self._ended and not exited(self.pidfd)

    def end(self) -> None:
        with self._lock:
            if not self._ended:
                self._ended = True
                os.close(self.pidfd)

    def destinations(self, block_ids: Sequence[int], layers: range) -> list[int]:
        """Addresses of layer `layers` in the registered regions (refused if a block is outside)."""
        top = max(block_ids, default=-1)
        out = []
        for index in layers:
            address, nbytes, row = self.regions[index]
            if (top + 1) * row > nbytes:
                raise PeerRefused(f"block {top} lies outside registered region {index} ({nbytes} bytes)")
            out.append(address)
        return out


class PeerRegistry:
    """The producer's Unix socket and the registrations of the processes that proved themselves."""

    def __init__(self, name_hint: str):
        self.name = f"pdcluster-kv-{os.getpid()}-{secrets.token_hex(8)}-{name_hint}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)  # abstract: no file to leak or clean up
        self._listener.listen(64)
        # token -> (pid, its pidfd, the connection it proved itself on)
        self._tokens: dict[str, tuple[int, int, socket.socket]] = {}
        self._registrations: dict[str, Registration] = {}
        self._lock = threading.Lock()
        self._warn = WarnOnce(logger)
        self._closed = False
        # poll/epoll, not select(): a descriptor past 1024 (a process holding many) is refused there.
        # The listener is registered here, not by the thread: a close() before the thread first ran
        # left it a closed socket to register (ValueError: fd -1).
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # close() wakes the thread through this pair: a listener closed under epoll wakes nothing
        self._wake, self._woken = socket.socketpair()
        self._selector.register(self._woken, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="kv-shm-peers", daemon=True)
        self._thread.start()

    # -- the socket: a thread accepts, answers tokens, and notices closed connections --------

    def _serve(self) -> None:
        with self._selector as selector:
            while not self._closed:
                try:
                    ready = selector.select()
                except (OSError, ValueError):
                    break  # closed under us
                for key, _ in ready:
                    sock = key.fileobj
                    if sock is self._woken:
                        break  # close(): _closed is set
                    if sock is self._listener:
                        conn = self._accept()
                        if conn is not None:
                            selector.register(conn, selectors.EVENT_READ)
                        continue
                    try:
                        data = sock.recv(64)
                    except OSError:
                        data = b""
                    if not data:  # the consumer closed it (or exited): its registration ends
                        selector.unregister(sock)
                        self._forget(sock)
            for key in list(selector.get_map().values()):
                if key.fileobj is not self._listener:
                    key.fileobj.close()  # the consumers' connections and the wake-up's end

    def _accept(self) -> socket.socket | None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return None
        pid, uid = peer_credentials(conn)
        with self._lock:
            full = len(self._tokens) >= MAX_PEERS
        if uid != os.getuid() or pid <= 0 or full:
            self.refuse(f"peer pid {pid} uid {uid} (this producer's uid {os.getuid()}, {MAX_PEERS} peers at most)")
            conn.close()
            return None
        try:
            pidfd = peer_pidfd(conn, pid)
        except OSError as exc:
            self.refuse(f"peer pid {pid}: {exc}")
            conn.close()
            return None
        token = secrets.token_hex(16)
        with self._lock:
            self._tokens[token] = (pid, pidfd, conn)
        try:
            conn.sendall(token.encode() + b"\n")
        except OSError:
            self._forget(conn)
            conn.close()
            return None
        return conn

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            for token in [t for t, (_, _, c) in self._tokens.items() if c is conn]:
                os.close(self._tokens.pop(token)[1])
                for rid in [r for r, reg in self._registrations.items() if reg.token == token]:
                    self._registrations.pop(rid).end()
        conn.close()

    # -- registrations ---------------------------------------------------------------------

    def register(self, token: str, pid: int, session: str, regions: Sequence[tuple[int, int, int]]) -> str:
        with self._lock:
            entry = self._tokens.get(token)
        if entry is None or entry[0] != pid:
            raise PeerRefused(f"registration for pid {pid} without that process's token")
        if not regions or any(n <= 0 or row <= 0 for _, n, row in regions):
            raise PeerRefused("registration names no (or empty) regions")
        with self._lock:
            if token not in self._tokens:  # the connection closed meanwhile (its pidfd with it)
                raise PeerRefused(f"pid {pid} disconnected while registering")
            if exited(entry[1]):  # its connection's close not yet seen: its pid may run another process
                raise PeerRefused(f"pid {pid} exited before it registered")
            # a pidfd of its own: the registration may outlive the connection's
            registration = Registration(secrets.token_hex(16), token, session, pid, os.dup(entry[1]), tuple(regions))
            self._registrations[registration.id] = registration
        return registration.id

    def lookup(self, registration_id: str, session: str, pid: int) -> Registration:
        with self._lock:
            registration = self._registrations.get(registration_id)
        if registration is None or registration.session != session:
            raise PeerRefused("unknown shm registration (or another session's)")
        if registration.pid != pid:
            raise PeerRefused(f"direct pull names pid {pid}, its registration pid {registration.pid}")
        if not registration.alive():
            raise PeerRefused(f"registered process {registration.pid} exited")
        return registration

    def refuse(self, reason: str) -> None:
        """Log a refusal once per reason."""
        self._warn(reason, "refused direct shm peer: %s", reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.send(b"\0")
        self._listener.close()
        self._thread.join(timeout=2)
        self._wake.close()
        with self._lock:
            for registration in self._registrations.values():
                registration.end()
            self._registrations.clear()
            for _, pidfd, _ in self._tokens.values():
                os.close(pidfd)
            self._tokens.clear()


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel recorded them:
    the connecting process's on a listener's side, the listening process's on a client's."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def peer_pidfd(conn: socket.socket, pid: int) -> int:
    """A pidfd of the process at the other end of `conn` (pid `pid` as it connected). The kernel's
    own where it has one (SO_PEERPIDFD): that process's even once it exited. Elsewhere one opened
    from the pid, kept only if the connection is still open after it: a process holding its end
    has not exited, so no other process had its pid when the pidfd was opened."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno != errno.ENOPROTOOPT:
            raise
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(conn, select.POLLRDHUP)
    if poller.poll(0):
        os.close(pidfd)
        raise OSError(errno.ESRCH, "it closed its connection (exited) before its pidfd was taken")
    return pidfd


def prove(name: str, timeout_s: float) -> tuple[socket.socket, str]:
    """Consumer: connect to a producer's peer socket; (the connection to keep open, the token)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + name)
        data = b""
        while not data.endswith(b"\n"):
            part = sock.recv(64)
            if not part:
                raise OSError("the producer closed its peer socket")
            data += part
    except OSError:
        sock.close()
        raise
    return sock, data.decode().strip()


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to timeout_s for process `pid` to exit; True once it has (or never existed)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:
        return exited(pidfd, timeout_s)
    finally:
        os.close(pidfd)
