"""Mooncake's transfer engine as the mooncake backend uses it (transports/mooncake.py has the
design): one engine per role and process (P2P handshake, no metadata server), memory regions
registered once, batched reads bounded by the pull's deadline, and one descriptor per run of
blocks consecutive on both sides.

`unavailable()` says, without importing Mooncake (which reads its settings when imported), why
this process cannot run the backend; the wheel links libibverbs/librdmacm even for TCP
(tools/system_deps.sh installs them).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import math
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from pdcluster.errors import KVTransferError, TransferTimeoutError
from pdcluster.kv_transfer.settings import KVTransferSettings

logger = logging.getLogger(__name__)

BATCH_PENDING = 1  # get_batch_transfer_status: 0 done, 1 still running, < 0 failed
# Mooncake 0.3.13's TCP transport queues at most 2048 transfers per peer and fails a whole batch
# beyond that (its MC_TCP_* queue settings do not raise it): a pull's ranges go in batches of
# at most this many, one batch at a time per peer.
MAX_BATCH = 2048
# First and longest wait between two looks at a running batch: a staged read's chunk takes a few
# ms, so a longer wait would leave the link idle for a good part of it.
POLL_S = (0.0001, 0.001)
OVERDUE_POLL_S = 0.1  # a batch past Mooncake's own timeout: asked after less often (it may never end)


# Mooncake's builds that read and write device memory in place (the `mooncake` package's
# distribution name, normalized); the non-CUDA build registers host memory only.
DEVICE_BUILDS = {
    "cuda": ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"),
    "npu": ("mooncake-transfer-engine-npu",),
}


@functools.lru_cache(maxsize=1)
def build() -> str:
    """The distribution that installed Mooncake's `mooncake` package ('' where none says so)."""
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    return names[0].lower().replace("_", "-") if names else ""


def registers(device_kind: str) -> bool:
    """Whether this process's Mooncake build reads and writes `device_kind` memory in place."""
    return device_kind == "cpu" or build() in DEVICE_BUILDS.get(device_kind, ())


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why this process cannot run the mooncake backend (None: it can). Host caches are read in
    place, device caches (CUDA, NPU) in place where the build registers device memory and else
    through host slots (staging.py), so only the engine counts."""
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake's transfer engine is not installed (mooncake-transfer-engine-non-cuda)"
    for library in ("libibverbs.so.1", "librdmacm.so.1"):
        try:
            ctypes.CDLL(library)
        except OSError as exc:
            return f"Mooncake's transfer engine needs {library} ({exc}; apt-get install libibverbs1 librdmacm1)"
    return None


def _configure(settings: KVTransferSettings) -> float:
    """Mooncake reads its settings from the environment when `mooncake.engine` is imported: its
    transfers bounded by the pull timeout (seconds), its log at warnings. An operator's own MC_*
    values win. (Its ports stay its own: it refuses ranges inside the kernel's ephemeral one,
    where the KV port range lies by default.) Returns the transfer timeout it runs with."""
    wanted = {
        "MC_TRANSFER_TIMEOUT": str(math.ceil(settings.pull_timeout_seconds)),
        "MC_LOG_LEVEL": "WARNING",
        "GLOG_minloglevel": "1",
    }
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    try:
        return float(os.environ["MC_TRANSFER_TIMEOUT"])
    except ValueError:
        return float(wanted["MC_TRANSFER_TIMEOUT"])


class MooncakeEngine:
    """One transfer engine of this process, the regions it registered, and batched reads."""

    def __init__(self, host: str, settings: KVTransferSettings):
        self.transfer_timeout_s = _configure(settings)  # Mooncake ends a transfer this long after it began
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
        # Registered (address, bytes) regions -> who holds them (None: this process's own cache,
        # registered on each pull and never let go), so one holder's close leaves another's.
        self._registered: dict[tuple[int, int], set[object]] = {}
        self._lock = threading.Lock()
        self._peers: dict[str, threading.Lock] = {}  # one batch in flight per peer (MAX_BATCH)
        # Peers with a batch Mooncake has not ended past its own timeout (and a grace period):
        # no new read goes to them until it ends (see _read_batch).
        self._wedged: set[str] = set()
        logger.info("Mooncake transfer engine %s (%s)", self.session, self.protocol)

    def register(self, regions: Sequence[tuple[int, int]], holder: object = None) -> None:
        """Register (address, bytes) regions for `holder`; a registered region a new one overlaps
        belonged to memory that is gone (reused since): it is unregistered."""
        with self._lock:
            new = [region for region in regions if region not in self._registered]
            for old in [r for r in self._registered if any(_overlap(r, region) for region in new)]:
                self.engine.unregister_memory(old[0])
                del self._registered[old]
            if new:
                rc = self.engine.batch_register_memory([a for a, _ in new], [n for _, n in new])
                if rc != 0:
                    raise KVTransferError(f"Mooncake could not register {len(new)} KV cache regions: code {rc}")
            for region in regions:
                self._registered.setdefault(region, set()).add(holder)

    def unregister(self, regions: Sequence[tuple[int, int]], holder: object) -> None:
        """`holder` lets go of regions whose memory it is about to free (a closed client's landing
        buffers, a stopped server's cache and slots); the last holder's release unregisters them
        (registered memory stays pinned on RDMA NICs)."""
        with self._lock:
            for region in regions:
                holders = self._registered.get(region)
                if holders is None:
                    continue
                holders.discard(holder)
                if not holders:
                    self.engine.unregister_memory(region[0])
                    del self._registered[region]

    def read(
        self, session: str, local: list[int], remote: list[int], lengths: list[int], deadline: float, grace_s: float
    ) -> None:
        """Read each remote range of `session` into the local one at the same index, at most
        MAX_BATCH ranges in flight to that peer (from any thread); raises on failure or past
        `deadline`, but only once the batch in flight ended: its bytes may land until then, into
        memory the caller reuses once this raises. A read that would wait past `deadline` for the
        peer's batch in flight, or a peer with a batch Mooncake left running past its own timeout,
        fails at once: nothing was submitted."""
        with self._lock:
            peer = self._peers.setdefault(session, threading.Lock())
            if session in self._wedged:
                raise KVTransferError(
                    f"Mooncake has a read from {session} running past its transfer timeout: no read goes there until it ends"
                )
        if not peer.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeoutError(f"an earlier Mooncake read from {session} held it past the pull's deadline")
        try:
            for start in range(0, len(local), MAX_BATCH):
                end = start + MAX_BATCH
                self._read_batch(session, local[start:end], remote[start:end], lengths[start:end], deadline, grace_s)
        finally:
            peer.release()

    def _read_batch(
        self, session: str, local: list[int], remote: list[int], lengths: list[int], deadline: float, grace_s: float
    ) -> None:
        started = time.monotonic()
        batch = self.engine.batch_transfer_async_read(session, local, remote, lengths)
        if not batch:
            raise KVTransferError(f"Mooncake could not start a read from {session}")
        # Past the deadline the batch is still awaited, until Mooncake ends it (failed, by its own
        # timeout): a read given up on while in flight could still write its bytes into blocks
        # vLLM has reused, or a landing buffer. One Mooncake leaves running past that timeout
        # (and a grace period) keeps its memory, and its peer gets no read, until it ends.
        overdue = started + self.transfer_timeout_s + grace_s
        wait, late = POLL_S[0], None
        try:
            while (status := self.engine.get_batch_transfer_status([batch])) == BATCH_PENDING:
                now = time.monotonic()
                if late is None and now > deadline:
                    late = now
                if now > overdue and session not in self._wedged:
                    with self._lock:
                        self._wedged.add(session)
                    logger.error(
                        "Mooncake read from %s still running %.0f s after it began, past Mooncake's transfer "
                        "timeout: its memory stays reserved and the peer gets no read until it ends",
                        session,
                        now - started,
                    )
                time.sleep(wait)  # poll interval: the engine's status has no blocking wait
                wait = min(wait * 2, POLL_S[1] if now <= overdue else OVERDUE_POLL_S)
        finally:
            with self._lock:
                self._wedged.discard(session)
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


def run_starts(*id_lists: Sequence[int]) -> np.ndarray:
    """Where each run of blocks consecutive in every list begins (indexes into the lists, which
    are as long as each other and not empty): one Mooncake descriptor per run and layer."""
    arrays = [np.asarray(ids, dtype=np.int64) for ids in id_lists]
    breaks = np.zeros(len(arrays[0]) - 1, dtype=bool)
    for ids in arrays:
        breaks |= np.diff(ids) != 1
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


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
    starts = run_starts(src, dst)
    runs = np.diff(np.concatenate((starts, [len(src)])))
    local, remote, lengths = [], [], []
    for local_base, remote_base, row in zip(local_bases, remote_bases, row_bytes):
        local.append(local_base + dst[starts] * row)
        remote.append(remote_base + src[starts] * row)
        lengths.append(runs * row)
    return (np.concatenate(local).tolist(), np.concatenate(remote).tolist(), np.concatenate(lengths).tolist())
