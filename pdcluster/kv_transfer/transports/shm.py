"""Shared-memory backend (same host): gRPC carries control only, KV bytes move through /dev/shm.

Producer (shm_server.py): `ShmExtension` adds the bidirectional `ShmPull` RPC to the control
server. A pull
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
in the background. With the lease's expiry at hand (`pull(lease_expiry=...)`, from its signed
params) and far enough off, it asks the producer nothing at all: it reads every layer itself
(`_read_leased`, a one-sided read as over RDMA), so a busy prefill core is not on the pull's path;
the release that follows tells the producer. Where the OS refuses (EPERM), the client falls back
to the ring for good. A direct pull that fails before the producer said its writes are done is
reported only once the producer's call has ended (`_fence`): vLLM would otherwise hand the blocks
to another request while the producer still writes into them.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from pdcluster.errors import KVTransferError, TransferTimeoutError
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports import cma, peers
from pdcluster.kv_transfer.transports.base import (
    CacheSink,
    ChunkSink,
    Transport,
    TransportClient,
)
from pdcluster.kv_transfer.transports.direct import DirectRead, DirectRefused
from pdcluster.kv_transfer.transports.grpc_transport import (
    GrpcClient,
    translate,
)
from pdcluster.kv_transfer.transports.segments import Segment
from pdcluster.kv_transfer.transports.shm_server import ShmExtension
from pdcluster.pidfds import exited
from pdcluster.protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

# A one-sided read needs the lease to hold this long past the read (checked before and after it,
# on this host's clock, the one the producer's expiry was set by): slack for the clock being
# stepped back meanwhile. A lease nearer its end is read through the producer, which holds it.
ONE_SIDED_MARGIN_S = 5.0


class ShmClient(GrpcClient):
    def __init__(self, endpoint: str, settings: KVTransferSettings):
        super().__init__(endpoint, settings)
        self._shm_pull = self.control.stub("ShmPull", pb.ShmPullRequest, pb.ShmChunk, kind="stream_stream")
        self._shm_register = self.control.stub("ShmRegister", pb.ShmRegisterRequest, pb.ShmRegisterResponse)
        self._segments: dict[str, Segment] = {}
        self._segments_lock = threading.Lock()
        self.direct = cma.available()  # until the OS refuses a direct read from this producer
        # The producer's last direct notice (pid, cache addresses, split): lets the next pull
        # read its half while the request is still on its way (see _read_early).
        self._peer: pb.ShmChunk | None = None
        self._settling: set = set()  # direct pulls' calls still ending (set ops are atomic)
        # (pid, pidfd) of the process the last notice named: a pidfd turns readable once that
        # very process exited, so a recycled pid is never mistaken for the producer.
        self._peer_process: tuple[int, int] | None = None
        self._peer_lock = threading.Lock()  # a pidfd is closed only while no one polls it
        # Our registration for direct pushes (peers.py), on the current session only. Made once,
        # by whichever pull comes first: the first pulls often start together, and a second
        # registration would replace the first, whose proof connection closing then makes the
        # producer forget the registration a pull in flight named (and refuse that pull).
        self._registration = ""
        self._proof: socket.socket | None = None  # the peer connection it was proven on
        # (pid, pidfd) of the producer's process at the other end of that connection, as the
        # kernel knows it: the process a notice names is watched through this pidfd, not one
        # opened from the notice's pid (by then the pid may be another process's).
        self._proven: tuple[int, int] | None = None
        # Taken after the session's lock, never before: a new session's hooks forget the
        # registration under the session's lock (_register takes its metadata first).
        self._registering = threading.Lock()
        self.control.on_new_session.append(self._new_session)

    def _new_session(self) -> None:
        """The producer forgot us (restarted): its registration, addresses and segments are gone
        (a dead producer's segments stay in memory while we map them)."""
        self._forget_registration()
        self._peer = None
        self._unmap()
        self._replace_peer_process()

    def _watch_peer_process(self, pid: int) -> None:
        """Watch the process a notice named: the one proven at the other end of our peer
        connection, else none (no one-sided reads until a notice names that one)."""
        with self._peer_lock:
            if self._peer_process is not None and self._peer_process[0] == pid:
                return
            proven = self._proven  # dup'd under the lock: _forget_registration closes it under it
            watched = (pid, os.dup(proven[1])) if proven is not None and proven[0] == pid else None
        self._replace_peer_process(watched)
        if watched is None:
            why = f"its peer connection's process is pid {proven[0]}" if proven else "no pidfd of its peer connection"
            logger.info("cannot watch KV producer pid %d (%s): pulls ask it first", pid, why)

    def _replace_peer_process(self, successor: tuple[int, int] | None = None) -> None:
        """Close the watched pidfd; watch `successor` (pid, pidfd) instead, if given."""
        with self._peer_lock:
            watched, self._peer_process = self._peer_process, successor
            if watched is not None:
                os.close(watched[1])

    def _peer_alive(self, pid: int) -> bool:
        with self._peer_lock:
            watched = self._peer_process
            if watched is None or watched[0] != pid:
                return False
            return not exited(watched[1])

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
        if self._read_leased(block_ids, sink, lease_expiry):
            assert self._remote_layout is not None
            return len(block_ids) * self._remote_layout.bytes_per_block()
        return super().pull(request_id, block_ids, sink, engine_id=engine_id, timeout_s=timeout_s)

    def _read_leased(self, block_ids: Sequence[int], sink: ChunkSink, lease_expiry: float) -> bool:
        """Read every layer of a live lease out of the producer's cache without asking it; False
        (nothing landed) when the pull must go through the producer instead.

        Safe for the reason _read_early is, with the lease's expiry in place of the producer's
        notice: a producer frees leased blocks only after the consumer's release or the
        lease's expiry, so blocks read while the expiry is still ahead (checked after the copy,
        by ONE_SIDED_MARGIN_S) held the prefill's KV; and the process read is the one that sent
        the last notice, alive after the copy (its pidfd), so its pid was not recycled meanwhile.
        A producer restart (a new session) forgets the notice."""
        peer = self._peer
        if not (self.settings.one_sided_reads and self.direct and peer is not None and lease_expiry > 0):
            return False

        def lease_and_peer_live() -> bool:
            return time.time() <= lease_expiry - ONE_SIDED_MARGIN_S and self._peer_alive(peer.pid)

        rows = sink.host_rows() if isinstance(sink, CacheSink) else None
        if rows is None or not lease_and_peer_live():
            return False
        assert isinstance(sink, CacheSink) and self._remote_layout is not None
        reader = DirectRead(peer, self._remote_layout, block_ids, sink, rows)
        try:
            reader.copy(0, len(rows))
        except (DirectRefused, KVTransferError) as exc:
            logger.info("one-sided read from %s failed (%s); asking the producer", self.endpoint, exc)
            return False
        if not lease_and_peer_live():
            return False  # read again, through the producer
        reader.landed(0, len(rows))
        sink.one_sided = True
        return True

    def _unmap(self) -> None:
        with self._segments_lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

    def _forget_registration(self) -> None:
        with self._registering:
            self._registration = ""
            if self._proof is not None:
                self._proof.close()
                self._proof = None
            with self._peer_lock:
                proven, self._proven = self._proven, None
                if proven is not None:
                    os.close(proven[1])

    def _register(self, sink: CacheSink) -> str:
        """Prove which process we are on the producer's peer socket and register our cache
        there (once per session); "" when the producer offers no direct pushes."""
        if self._registration or not self.shm_socket:
            return self._registration
        metadata = self.control.metadata("ShmRegister")  # may open a session: before our lock
        with self._registering:
            if self._registration:
                return self._registration
            regions = sink.host_regions()
            assert regions is not None
            try:
                proof, token = peers.prove(self.shm_socket, self.settings.connect_timeout_seconds)
            except OSError as exc:
                raise DirectRefused(f"peer socket of {self.endpoint}: {exc}") from exc
            proven = self._proven_producer(proof)
            request = pb.ShmRegisterRequest(
                token=token,
                pid=os.getpid(),
                regions=[pb.Region(address=a, nbytes=n, row_bytes=r) for a, n, r in regions],
            )
            try:
                reply = self._shm_register(
                    request,
                    metadata=metadata,
                    timeout=self.settings.connect_timeout_seconds,
                )
            except BaseException as exc:
                proof.close()
                if proven is not None:
                    os.close(proven[1])
                if not isinstance(exc, grpc.RpcError):
                    raise
                error = translate(exc, self.endpoint, "KV shm registration")
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                    raise DirectRefused(str(error)) from None
                raise error from None
            self._proof, self._registration = proof, reply.registration
            with self._peer_lock:
                self._proven = proven
            return self._registration

    def _proven_producer(self, proof: socket.socket) -> tuple[int, int] | None:
        """(pid, pidfd) of the producer's process, from our peer connection to it; None where no
        pidfd can be had (one-sided reads then stay off)."""
        try:
            pid, _ = peers.peer_credentials(proof)
            return pid, peers.peer_pidfd(proof, pid)
        except OSError as exc:
            logger.info("no pidfd of KV producer %s: %s", self.endpoint, exc)
            return None

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
        # A new session (the producer forgot ours: call() retries on one) forgets our
        # registration before it is sent, not after (the producer would refuse the old one)
        self.control.session()
        # Before the call begins: the producer's own count of our deadline (deadline_ms) starts
        # later, so its lease hold outlasts every read we accept (checked after the last one).
        began, noticed = time.monotonic(), 0.0  # when the pull began, and the producer's notice came
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
                    deadline_ms=math.ceil(timeout_s * 1000),
                )
            )

        def messages() -> Iterator[pb.ShmPullRequest]:
            while (message := outbox.get()) is not None:
                yield message

        # A direct pull lets the producer write into our cache: it has no gRPC deadline, which
        # would end the call on our side while the producer may still be writing. Our deadline
        # half-closes our side instead (the producer then writes nothing more), and a pull that
        # fails before the producer said its writes are done waits for its call to end (_fence)
        # before the failure reaches vLLM, which would hand these blocks to another request.
        direct_call = rows is not None
        call = self._shm_pull(
            messages(), metadata=self.control.metadata("ShmPull"), timeout=None if direct_call else timeout_s
        )
        expired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (expired.set(), outbox.put(None)))

        def late(stage: str) -> TransferTimeoutError:
            return TransferTimeoutError(
                f"KV shm pull of {request.request_id} from {self.endpoint} passed its {timeout_s:g} s deadline: {stage}"
            )

        if direct_call:
            timer.daemon = True
            timer.start()
        received = consumed = 0
        segment: Segment | None = None
        direct: DirectRead | None = None
        writes_done = not direct_call
        try:
            early = self._read_early(block_ids, sink, rows) if rows is not None else None
            for note in call:
                if note.pid or note.pushed:
                    if rows is None or (note.pid and direct) or (note.pushed and not direct):
                        raise KVTransferError(f"unexpected direct shm notice from {self.endpoint}")
                    assert isinstance(sink, CacheSink) and self._remote_layout is not None
                    if note.pid:
                        noticed = time.monotonic()
                        self._peer = pb.ShmChunk(
                            pid=note.pid,
                            layer_addresses=note.layer_addresses,
                            push_from_layer=note.push_from_layer,
                        )
                        self._watch_peer_process(note.pid)
                        if early is not None and early.note == self._peer:
                            direct = early  # our half is in; the notice says it was leased
                            direct.landed(0, note.push_from_layer)
                        else:
                            direct = DirectRead(note, self._remote_layout, block_ids, sink, rows)
                            direct.read(0, note.push_from_layer)
                    else:
                        writes_done = True
                        if expired.is_set():
                            raise late(
                                f"the producer's notice came after {noticed - began:.1f} s, "
                                f"its push ended after {time.monotonic() - began:.1f} s"
                            )
                        received += direct.finish(note.pushed_layers)
                        if time.monotonic() - began > timeout_s:
                            # Our reads may have run past the producer's hold of the lease (it
                            # waits for our word only until our deadline): what they copied may
                            # be another request's. (A process stopped mid-read, then resumed.)
                            raise late(
                                f"our reads of the producer's cache ended after {time.monotonic() - began:.1f} s"
                            )
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
            if not writes_done:
                self._await_exit(exc.code())
            if rows is not None and exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._forget_registration()
                raise DirectRefused(exc.details()) from None
            raise translate(exc, self.endpoint, f"KV shm pull of {request.request_id}") from None
        except BaseException:
            if writes_done:
                call.cancel()
            else:
                outbox.put(None)
                self._fence(call)
            raise
        finally:
            timer.cancel()
            outbox.put(None)
        if direct_call and not writes_done:  # the call ended without the producer's last notice
            self._await_exit(call.code())
            if expired.is_set():
                raise late(
                    f"the producer's notice came after {noticed - began:.1f} s, its push never ended"
                    if noticed
                    else "no notice from the producer"
                )
        return self.check_total(request.request_id, block_ids, received)

    def _fence(self, call) -> None:
        """Wait until the producer's side of a direct pull ended: then none of its writes into
        our cache can still be running (they run inside its call)."""
        try:
            for _ in call:
                continue  # what it still says no longer matters
        except grpc.RpcError as exc:
            self._await_exit(exc.code())
            return
        self._await_exit(call.code())

    def _await_exit(self, code: grpc.StatusCode) -> None:
        """A call that ended without the producer's own status (its connection broke, its server
        stopped) proves nothing about a write still running in its process: wait for the process
        to exit (bounded), when we know it."""
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
            return
        pid = self._peer.pid if self._peer is not None else 0
        if not pid or not peers.wait_exit(pid, self.settings.pull_timeout_seconds):
            logger.warning(
                "KV producer %s ended a direct pull without its status; pid %s may live on", self.endpoint, pid
            )

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
        self._unmap()
        self._forget_registration()
        self._replace_peer_process()
        super().close()


class ShmTransport(Transport):
    name = "shm"

    def server_extension(self, producer: KVProducer, host: str) -> ShmExtension:
        return ShmExtension(producer, self.settings.server_threads)

    def connect(self, endpoint: str) -> TransportClient:
        return ShmClient(endpoint, self.settings)
