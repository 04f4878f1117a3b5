"""Why a KV pull failed, told to the engine's own HTTP answer for that request.

With `kv_transfer.failure_policy: fail` vLLM finishes a request whose load failed with an error,
and its OpenAI server answers "Internal server error": the reason lives in the connector's worker
half (the process holding the KV cache), the answer is written by the engine's API process. This
is the channel between the two, used for nothing else:

- The engine host opens a Unix datagram socket in a private directory (`FailureInbox`) and names
  it in the environment its engine processes inherit (FAILURE_SOCKET_ENV).
- With that policy, the worker half sends one datagram per failed pull (`report_failure`) *before*
  it reports the load as failed to vLLM, so the datagram is in the socket when the error reaches
  the API process. That send never blocks: a report that finds the socket full is dropped (and
  logged), and the client gets vLLM's own error for that request.
- The API process reads the socket as reports arrive, and the engine app's middleware
  (engine/kv_errors.py) looks a reason up by the request's lease (`remote_request_id` of its
  kv_transfer_params): an exact key.
- A request admitted ahead of its prefill whose lease never came (ahead.py) is reported under its
  lease key with `abort` (vLLM's request id), whatever the policy: the inbox's `on_abort` (the
  engine host) aborts it, and its answer carries the reason. That report waits for room in the
  socket (up to ABORT_SEND_S; it is sent from a lookup thread, off the engine's path): dropped,
  its request would hold its blocks until its deadline.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from pdcluster.pidfds import private_dir

logger = logging.getLogger(__name__)

FAILURE_SOCKET_ENV = "PDCLUSTER_KV_FAILURE_SOCKET"
MAX_REASON_CHARS = 2000
MAX_KEPT = 1024  # reasons kept for answers not yet written (the oldest go first)
ABORT_SEND_S = 10.0  # how long an abort report waits for room in a full inbox


def report_failure(lease_request_id: str, producer_engine_id: str, reason: str, abort: str = "") -> None:
    """Tell this engine's API process why the pull of `lease_request_id` failed (best effort:
    without the channel the client gets vLLM's own error); `abort`: vLLM's id of a request the
    API process must abort."""
    path = os.environ.get(FAILURE_SOCKET_ENV)
    if not path:
        if abort:
            logger.error("no KV failure inbox: request %s cannot be aborted and waits for its deadline", abort)
        return
    message = json.dumps(
        {"lease": lease_request_id, "producer": producer_engine_id, "reason": reason[:MAX_REASON_CHARS], "abort": abort}
    ).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            if abort:
                sock.settimeout(ABORT_SEND_S)  # the inbox's reader makes room as it reads
                sock.sendto(message, path)
            else:
                sock.sendto(message, socket.MSG_DONTWAIT, path)
    except (BlockingIOError, TimeoutError):
        if abort:
            logger.error("the KV failure inbox stayed full: request %s is not aborted, waits for its deadline", abort)
        else:
            logger.warning("the KV failure inbox is full; the failure of %s goes unexplained", lease_request_id)
    except OSError as exc:
        logger.warning("could not report the KV failure of %s to the API process: %s", lease_request_id, exc)


class FailureInbox:
    """The API process's end: reasons by lease request id. A thread moves each report out of the
    socket as it arrives (the kernel queues only a few datagrams per socket); `take` drains what
    is left first, so a report sent before the failure was reported is always found."""

    def __init__(self, on_abort: Callable[[str], None] | None = None) -> None:
        self.on_abort = on_abort  # called on the reader thread with vLLM's request id
        self._dir = Path(private_dir("pdcluster-kv-failures-", "KV failure inbox", room=len("inbox")))  # mode 0700
        self.path = str(self._dir / "inbox")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.setblocking(False)
        self._reasons: OrderedDict[str, tuple[str, str, bool]] = OrderedDict()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._reader = threading.Thread(target=self._read, name="kv-failure-inbox", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with selectors.DefaultSelector() as selector:  # poll/epoll: any fd number
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj == self._wake_r for key, _ in ready):
                    return
                self.drain()

    def drain(self) -> None:
        """Move what the socket holds into the table (never waits)."""
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            try:
                message = json.loads(data)
                abort = str(message.get("abort") or "")
                self._reasons[str(message["lease"])] = (str(message["producer"]), str(message["reason"]), bool(abort))
            except (ValueError, KeyError, TypeError):
                logger.warning("ignored a malformed KV failure report")
                continue
            if abort and self.on_abort is not None:
                self.on_abort(abort)
            while len(self._reasons) > MAX_KEPT:
                self._reasons.popitem(last=False)

    def take(self, lease_request_id: str) -> tuple[str, str, bool] | None:
        """(producer engine id, reason, aborted: a request admitted ahead whose lease never came)
        of the failed pull of that lease, once; None if none."""
        with self._lock:
            self._drain()
            return self._reasons.pop(lease_request_id, None)

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._reader.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._sock.close()
        Path(self.path).unlink(missing_ok=True)
        self._dir.rmdir()
