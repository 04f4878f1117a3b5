"""A consumer's lease messages to producers: releases (the blocks may be freed) and renewals (keep the
blocks of a request that waits here), sent in the background, each kind on a pool of its own. They
never queue behind pulls: a stalled pull would otherwise hold the blocks of pulls already done, and
let the leases of waiting requests expire; nor renewals behind releases to a producer that answers
slowly. Renewals cover every lease this consumer holds unpulled (`hold`): the requests queued in
its scheduler (the step's metadata names each once) and the pulls waiting for a pull thread. They
run on a clock of their own (a thread), not on the engine's steps: an engine core that takes no
step for a while (a long step, a compile, a starved core) would otherwise let the leases of its
queued requests expire. Each lease is renewed every sixth of its producer's `lease_seconds` (vLLM's
NIXL heartbeat) counted from its filing or last renewal, and a renewal keeps it that long: the
producer's params say how long, which need not be this consumer's setting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.params import KVParams
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.stats import ThreadClock, machine_stalls
from pdcluster.kv_transfer.transports.base import TransportClient

logger = logging.getLogger(__name__)

RENEWALS_PER_LEASE = 6  # a lease is renewed every sixth of its duration
RELEASED_KEPT = 4096  # leases this consumer released, remembered so that none is pulled again
LATE_WARNING = 2  # renewals this many periods late say so (the process did not run)


@dataclass
class _Held:
    lease: KVParams
    endpoint: str
    seconds: float  # how long a renewal keeps it (the producer's lease_seconds)
    due: float  # monotonic time of its next renewal
    until: float = 0.0  # unix time the last renewal kept it to (0: never renewed)


def known_ended(lease: KVParams, kept_until: float, now: float) -> bool:
    """Whether `lease` is over for sure at unix time `now`: past its signed expiry and never renewed
    here (`kept_until` 0). A lease this consumer renewed is not: the producer's deadline runs from
    when the renewal reached it, later than the renewal's own estimate (`kept_until`)."""
    return not kept_until and lease.remote_lease_expiry <= now


def _key(lease: KVParams) -> tuple[str, str]:
    return lease.remote_engine_id, lease.remote_request_id


class LeaseMessages:
    def __init__(
        self,
        settings: KVTransferSettings,
        engine_id: str,
        endpoint_for: Callable[[KVParams], str],
        connection: Callable[[str, str], TransportClient],
    ):
        self.settings = settings
        self.engine_id = engine_id
        self._endpoint_for = endpoint_for  # raises for params no producer of this cluster signed
        self._connection = connection
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-lease-releases")
        # renewals never queue behind releases to a producer that answers slowly
        self._renewals = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-lease-renewals")
        self._cond = threading.Condition()
        self._held: dict[tuple[str, str], _Held] = {}  # (producer engine, its request id) -> lease
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()  # the latest RELEASED_KEPT
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, name="kv-lease-keeper", daemon=True)
        self._keeper.start()

    # -- what the worker calls ---------------------------------------------------------------

    def hold(self, lease: KVParams) -> None:
        """Renew `lease` until `drop` (its pull is done, or it is released). Only a lease a
        producer of this cluster signed is renewed (nor is anything else dialed: its pull fails
        with the reason)."""
        try:
            endpoint = self._endpoint_for(lease)
        except KVTransferError:
            return
        seconds = lease.lease_seconds_or(self.settings.lease_seconds)
        filed = lease.filed_at(self.settings.lease_seconds)  # unix, the producer's clock
        now = time.monotonic()
        due = max(now, now + (filed - time.time()) + seconds / RENEWALS_PER_LEASE)
        with self._cond:
            if self._closed or _key(lease) in self._held:
                return
            self._held[_key(lease)] = _Held(lease, endpoint, seconds, due)
            self._cond.notify()

    def kept_until(self, lease: KVParams) -> float:
        """Until when this consumer's renewals kept `lease` (unix time; 0: never renewed)."""
        with self._cond:
            held = self._held.get(_key(lease))
            return held.until if held is not None else 0.0

    def released(self, lease: KVParams) -> bool:
        """Did this consumer release `lease` (after a pull of it, or a failed one)? Its blocks may
        be another request's by now: a one-sided read would not know."""
        with self._cond:
            return _key(lease) in self._released

    def drop(self, lease: KVParams) -> None:
        """No more renewals for `lease`."""
        with self._cond:
            self._held.pop(_key(lease), None)

    def release_later(self, lease: KVParams, transferred: bool) -> None:
        """No more renewals, and the producer may free the blocks. The load's report to vLLM does
        not wait for the producer's answer. A release never sent (the worker is shutting down) is
        ended by the lease's expiry."""
        self.drop(lease)
        with self._cond:
            self._released[_key(lease)] = None
            while len(self._released) > RELEASED_KEPT:
                self._released.popitem(last=False)
        try:
            self._pool.submit(self._release, lease, transferred)
        except RuntimeError:  # the pool was shut down
            logger.debug("not releasing %s: shutting down", lease.remote_request_id)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._held.clear()
            self._cond.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._renewals.shutdown(wait=False, cancel_futures=True)

    # -- the keeper thread ---------------------------------------------------------------------

    def _keep(self) -> None:
        clock = ThreadClock()  # this thread's waits for a CPU since it last renewed
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._held:
                    self._cond.wait()
                    clock = ThreadClock()
                    continue
                now = time.monotonic()
                first = min(held.due for held in self._held.values())
                if first > now:
                    self._cond.wait(first - now)
                    continue
                due = self._take_due(now, clock)
                clock = ThreadClock()
            for endpoint, request_ids in due.items():
                try:
                    self._renewals.submit(self._renew, endpoint, request_ids)
                except RuntimeError:
                    logger.debug("not renewing %d leases: shutting down", len(request_ids))

    def _take_due(self, now: float, clock: ThreadClock) -> dict[str, list[str]]:
        """The leases to renew now, by endpoint (those due within half a period are renewed with
        them, in one call), each marked renewed; those known to have ended are let go. Under the
        lock."""
        wall = time.time()
        due: dict[str, list[str]] = {}
        late = 0.0
        for key, held in list(self._held.items()):
            period = held.seconds / RENEWALS_PER_LEASE
            if held.due > now + period / 2:
                continue
            if known_ended(held.lease, held.until, wall):
                del self._held[key]  # not renewed (nor dialed)
                continue
            if now - held.due > LATE_WARNING * period:
                late = max(late, now - held.due)
            due.setdefault(held.endpoint, []).append(held.lease.remote_request_id)
            held.due, held.until = now + period, wall + held.seconds
        if late:
            # Nothing here waits on the engine: this thread did not run for that long, for want of
            # a CPU (its cores busy), or of its process (its interpreter lock held, a stop)
            _, runnable = clock.elapsed()
            logger.warning(
                "KV lease renewals ran %.1f s late: this thread waited %.1f s of it for a CPU, the rest "
                "for its process (interpreter lock, a stop); machine stalls over 10 s: %s",
                late,
                runnable,
                machine_stalls() or "not kept",
            )
        return due

    # -- the pool -----------------------------------------------------------------------------

    def _release(self, lease: KVParams, transferred: bool) -> None:
        """Tell the producer it may free the lease's blocks (every producer's gRPC control
        server answers Release, whatever backend moved the bytes)."""
        try:
            self._connection(self._endpoint_for(lease), "grpc").release(
                lease.remote_request_id,
                transferred=transferred,
                engine_id=self.engine_id,
                timeout_s=self.settings.release_timeout_seconds,
            )
        except Exception as exc:  # noqa: BLE001 - runs on the pool: nothing may escape unseen
            # The producer's lease expiry frees the blocks if this message is lost.
            logger.warning("KV release of %s failed: %s: %s", lease.remote_request_id, type(exc).__name__, exc)

    def _renew(self, endpoint: str, request_ids: list[str]) -> None:
        try:
            renewed = self._connection(endpoint, "grpc").renew(
                request_ids, engine_id=self.engine_id, timeout_s=self.settings.release_timeout_seconds
            )
            logger.debug("renewed %d of %d leases on %s", renewed, len(request_ids), endpoint)
        except Exception as exc:  # noqa: BLE001 - runs on the pool: nothing may escape unseen
            logger.warning(
                "renewing %d leases on %s failed: %s: %s", len(request_ids), endpoint, type(exc).__name__, exc
            )
