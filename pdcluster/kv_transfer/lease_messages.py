"""A consumer's lease messages to producers: releases (the blocks may be freed) and renewals
(keep the blocks of a request that waits here), sent in the background on a pool of their own.

They never queue behind pulls: a stalled pull would otherwise hold the blocks of pulls already
done, and let the leases of waiting requests expire. Renewals cover every request whose lease
this consumer still has to pull: the scheduler's queued requests (their renewals come in the
step's metadata) and the pulls waiting for a pull thread (`keep`: a burst of slow pulls would
otherwise outlast the leases of the pulls behind them). A renewal extends a lease to its
producer's `lease_seconds` from now (`RenewalCadence`: the producer's params say how long, which
need not be this consumer's setting).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.params import KVParams
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.transports.base import TransportClient

logger = logging.getLogger(__name__)


class RenewalCadence:
    """When a consumer renews the leases it keeps, and until when a renewal keeps one.

    A renewal keeps a lease for its producer's lease_seconds (its params say; the consumer's own
    setting where they do not). Renewals go out every sixth of the shortest lease seen (vLLM's NIXL
    heartbeat), so a producer whose leases are shorter than this consumer's are renewed in time."""

    def __init__(self, lease_seconds: float):
        self.default = lease_seconds
        self.shortest = lease_seconds
        self.last = 0.0  # unix time of the last renewals

    def saw(self, lease: KVParams) -> None:
        """A lease this consumer may renew."""
        self.shortest = min(self.shortest, lease.lease_seconds_or(self.default))

    def due(self, now: float) -> bool:
        return now - self.last >= self.shortest / 6

    def kept_until(self, lease: KVParams, now: float) -> float:
        """Until when a renewal sent at `now` keeps `lease` (unix time)."""
        return now + lease.lease_seconds_or(self.default)


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
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-lease-messages")
        self._lock = threading.Lock()
        self._kept: dict[str, float] = {}  # request id -> unix time `keep`'s renewals hold it to
        self.cadence = RenewalCadence(settings.lease_seconds)  # of `keep`; the worker tells it `saw`

    def release_later(self, lease: KVParams, transferred: bool) -> None:
        """The load's report to vLLM does not wait for the producer's answer. A release never
        sent (the worker is shutting down) is ended by the lease's expiry."""
        try:
            self._pool.submit(self._release, lease, transferred)
        except RuntimeError:  # the pool was shut down
            logger.debug("not releasing %s: shutting down", lease.remote_request_id)

    def renew(self, leases: Iterable[KVParams]) -> None:
        """Renew `leases`, one call per producer endpoint (only those a producer of this cluster
        signed: the pull of any other fails with the reason)."""
        by_endpoint: dict[str, list[str]] = {}
        for lease in leases:
            try:
                endpoint = self._endpoint_for(lease)
            except KVTransferError:
                continue
            by_endpoint.setdefault(endpoint, []).append(lease.remote_request_id)
        for endpoint, request_ids in by_endpoint.items():
            try:
                self._pool.submit(self._renew, endpoint, request_ids)
            except RuntimeError:
                logger.debug("not renewing %d leases: shutting down", len(request_ids))

    def keep_due(self) -> bool:
        """Whether `keep` would renew now (`RenewalCadence`, as the scheduler's renewals; the
        caller need not gather what waits on the steps between)."""
        return self.cadence.due(time.time())

    def keep(self, waiting: dict[str, tuple[KVParams, float]]) -> None:
        """Renew the leases of pulls waiting for a pull thread (request id -> (lease, until when
        it is known to hold: PullSpec.lease_until)), at the scheduler's cadence (`keep_due`). A
        lease known to have ended is not renewed (nor dialed)."""
        now = time.time()
        with self._lock:
            if not waiting or not self.cadence.due(now):
                return
            self.cadence.last = now
            self._kept = {rid: until for rid, until in self._kept.items() if until > now}  # kept_until pops the rest
            live = [rid for rid, (_, until) in waiting.items() if max(until, self._kept.get(rid, 0.0)) > now]
            for request_id in live:
                self._kept[request_id] = self.cadence.kept_until(waiting[request_id][0], now)
        self.renew(waiting[rid][0] for rid in live)

    def kept_until(self, request_id: str) -> float:
        """Until when `keep` renewed this request's lease (unix time; 0: never)."""
        with self._lock:
            return self._kept.pop(request_id, 0.0)

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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
