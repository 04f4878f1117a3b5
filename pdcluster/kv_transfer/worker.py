"""Worker half of the connector (runs in each model-runner process, beside the KV cache).

Producer: `register_kv_caches` starts the transport server over the cache; leases announced by
the scheduler (in the next step's metadata, or at once where it shares this process:
colocated.py) are filed with the event recorded after the forward that wrote their blocks, and
released/expired leases are reported as `finished_sending` so vLLM frees the blocks.

Consumer: pulls announced by the scheduler run on a small thread pool: the gRPC control handshake
with the producer's endpoint (once; it says where the producer runs and what it offers), the
backend picked from that (transports/selection.py, its own handshake once per endpoint), the
blocks moved into the local cache through the staging scatterer, then the producer's lease
released in the background (vLLM need not wait for that answer; lease_messages.py, which also
renews, on a clock of its own, the leases of requests queued in the scheduler and of pulls still
waiting for a pull thread). Completed pulls are reported as
`finished_recving` after the compute stream was made to wait on their copy event; failed ones
also as `failed_recving`, and vLLM recomputes or fails the request per `kv_load_failure_policy`.
Every pull has a deadline. Requests admitted ahead of their prefill find their lease first (ahead.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.errors import KVTransferError, LeaseExpiredError, PortTakenError, UntrustedParamsError
from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer import colocated
from pdcluster.kv_transfer.ahead import AheadPulls
from pdcluster.kv_transfer.failures import report_failure
from pdcluster.kv_transfer.faults import FaultInjector
from pdcluster.kv_transfer.kv_cache import PagedKVCache
from pdcluster.kv_transfer.lease_messages import LeaseMessages, known_ended
from pdcluster.kv_transfer.links import ProducerLinks
from pdcluster.kv_transfer.metadata import (
    LeaseSpec,
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PDWorkerMetadata,
    PullSpec,
)
from pdcluster.kv_transfer.params import KVParams
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.staging import BlockScatterer, DeviceContext, Pool
from pdcluster.kv_transfer.stats import PDTransferStats, ThreadClock, failure_cause
from pdcluster.kv_transfer.transports import create_transport, serve_backends
from pdcluster.kv_transfer.transports.base import CacheSink, Transport, TransportClient, TransportServer
from pdcluster.kv_transfer.transports.selection import offered_backends

logger = logging.getLogger(__name__)


@dataclass
class PullResult:
    request_id: str
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    event: Any = None  # device event the compute stream must wait on (None on CPU)
    error: str = ""
    cause: str = ""  # failure_cause of a failed pull
    lease_wait: float = 0.0  # handoff stage (stats): lease filed on the producer -> pull started
    done_at: float = 0.0  # time.monotonic() when the bytes were in: vLLM hears of it later
    one_sided: bool = False  # read without a call to the producer (CacheSink.one_sided)
    thread: tuple[float, float] = (0.0, 0.0)  # of `seconds`: on a CPU, waiting for one (ThreadClock)


class ConnectorWorker:
    def __init__(
        self,
        settings: KVTransferSettings,
        engine_id: str,
        *,
        model: str,
        block_size: int,
        num_blocks: int | None,
        tp_size: int,
        tp_rank: int,
        is_producer: bool,
        is_consumer: bool,
    ):
        self.settings = settings
        self._params_key = derive_key(settings.secret_value(), KV_PARAMS)
        self.faults = FaultInjector(settings.fault_injection)
        self.engine_id, self.model = engine_id, model
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self._transports: dict[str, Transport] = {}
        self.offers: list[str] = []
        self.cache: PagedKVCache | None = None
        self.ctx: DeviceContext | None = None
        self.producer: KVProducer | None = None
        self.server: TransportServer | None = None
        self._last_step_event = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[PullResult]] = {}
        self._messages: LeaseMessages | None = None  # releases and renewals
        self._links: ProducerLinks | None = None  # consumer: clients of producers
        self._transports_lock = threading.Lock()
        self._scatterers: Pool[BlockScatterer] | None = None
        self.stats = PDTransferStats()
        self._pending_lock = threading.Lock()  # lookup threads add the pulls of found leases
        self._ahead: AheadPulls | None = None
        self.waker = colocated.EngineWaker()  # wakes an engine core waiting idle (colocated.py)

    # -- startup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.cache = PagedKVCache(
            kv_caches,
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
        )
        self.cache.back_with_huge_pages()
        self.ctx = DeviceContext(self.cache.device)
        self.offers = offered_backends(self.settings.backend, self.settings.bind_host)
        logger.info(
            "KV cache registered: %d layers, %d blocks, %d bytes/block, device %s",
            len(self.cache.layer_names),
            self.cache.num_blocks,
            self.cache.layout.bytes_per_block(),
            self.cache.device,
        )
        if self.is_producer:
            self.producer = KVProducer(
                self.cache,
                self.engine_id,
                max_chunk_bytes=self.settings.max_chunk_bytes,
                lease_wait_s=self.settings.lease_wait_seconds,
                lease_seconds=self.settings.lease_seconds,
                faults=self.faults,
                on_lease_end=self.waker.wake,
            )
            self.server = self._bind_server()
            if self.tp_size == 1:  # the only rank: the scheduler half may share our process
                colocated.register(self.engine_id, self)
        if self.is_consumer:
            cache = self.cache
            chunk = self.settings.max_chunk_bytes
            self._scatterers = Pool(lambda: BlockScatterer(cache, chunk))
            self._executor = ThreadPoolExecutor(max_workers=self.settings.pull_threads, thread_name_prefix="kv-pull")
            self._links = links = ProducerLinks(self.settings, self.engine_id, cache, self.offers, self._transport)
            self._messages = LeaseMessages(self.settings, self.engine_id, self._endpoint, links.connection)
            self._ahead = AheadPulls(
                engine_id=self.engine_id,
                params_key=self._params_key,
                timeout_s=self.settings.release_timeout_seconds,
                endpoint_for=self._endpoint,
                connection=links.connection,
                submit_pull=self._submit_pull,
                report_failed=self._report_failed,
                release=lambda lease: self._messages.release_later(lease, False),
                hold=self._messages.hold,
            )
        if self.tp_size == 1:  # the only rank: the engine core may share our process
            colocated.register_waker(self.waker)

    def _transport(self, name: str) -> Transport:
        with self._transports_lock:
            transport = self._transports.get(name)
            if transport is None:
                assert self.cache is not None
                transport = self._transports[name] = create_transport(name, self.settings, str(self.cache.device))
            return transport

    def _bind_server(self) -> TransportServer:
        assert self.producer is not None
        lo, hi = self.settings.port_range
        ports = [0] if lo == hi == 0 else list(range(lo + self.tp_rank, hi + 1, self.tp_size))
        last_error: Exception | None = None
        for port in ports:
            try:
                return serve_backends(
                    self.offers,
                    self.settings,
                    self.producer,
                    self.settings.bind_host,
                    port,
                    str(self.cache.device) if self.cache is not None else "cpu",
                )
            except PortTakenError as exc:  # (a backend that cannot start fails alike on any port)
                last_error = exc
        raise KVTransferError(
            f"no free KV port in {self.settings.bind_host}:{lo}-{hi} for tp rank {self.tp_rank}: {last_error}"
        )

    def handshake_metadata(self) -> PDHandshakeMetadata:
        endpoint = None
        if self.server is not None:
            port = self.server.address.rpartition(":")[2]
            endpoint = f"{self.settings.host_for_peers}:{port}"
        return PDHandshakeMetadata(endpoint=endpoint)

    # -- per step ----------------------------------------------------------------------------

    def file_leases(self, leases: list[LeaseSpec], wake: bool = True) -> None:
        """Hold finished prefills' blocks for their consumers (from the step's metadata, or at
        once from the scheduler half in this process: colocated.py, which wakes their waiting
        consumers itself, `wake_lookups`, once the step's outputs are queued)."""
        assert self.producer is not None
        now_wall, now_mono = time.time(), time.monotonic()
        for lease in leases:
            if lease.stopped:
                self.producer.leases.none_comes(lease.key, lease.first_token, wake=wake)
                continue
            self.producer.leases.add(
                lease.request_id,
                lease.block_ids,
                now_mono + (lease.expiry_unix - now_wall),
                ready_event=self._last_step_event,
                key=lease.key,
                handout=(lease.params, lease.first_token) if lease.key else None,
                wake=wake,
            )

    def wake_lookups(self) -> None:
        """Wake the pulls and handout lookups waiting for leases filed with wake=False (called from
        the engine core's loop: never raises)."""
        if self.producer is not None:
            self.producer.leases.wake()

    def bind(self, meta: PDConnectorMetadata) -> None:
        if meta.new_leases:
            self.file_leases(meta.new_leases)
        if self.is_consumer and self._ahead is not None and self._messages is not None:
            for lease in meta.queued:  # before this step's pulls and releases, which may end them
                self._messages.hold(lease)
            for spec in meta.awaited:  # likewise
                self._ahead.queue(spec)
            for pull in meta.pulls:
                if pull.awaiting is not None:
                    self._ahead.add(pull)
                else:
                    self._submit_pull(pull)
            for request_id in meta.abandoned:
                self._ahead.abandon(request_id)
            for spec in meta.forsaken:
                self._ahead.forsake(spec)
            for release in meta.releases:
                logger.debug("releasing %s unpulled: %s", release.remote.remote_request_id, release.reason)
                self._messages.release_later(release.remote, False)

    def after_forward(self) -> None:
        """End of a step (target and draft forwards): remember what the producer must wait on."""
        if self.producer is not None and self.ctx is not None:
            self._last_step_event = self.ctx.record_compute_event()

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        sending: set[str] = set()
        if self.producer is not None:
            for lease in self.producer.leases.collect_finished():
                sending.add(lease.request_id)
                if lease.expired:
                    self.stats.add("leases_expired")
                    logger.warning(
                        "KV lease of %s expired after %.1f s without a consumer release",
                        lease.request_id,
                        time.monotonic() - lease.created,
                    )
                else:
                    self.stats.add("leases_released")
        recving: set[str] = set()
        failed: set[str] = set()
        with self._pending_lock:
            done = [(request_id, f) for request_id, f in self._pending.items() if f.done()]
            for request_id, _ in done:
                del self._pending[request_id]
        for request_id, future in done:
            result = future.result()
            assert self.ctx is not None
            # Attention must not read the blocks before their copies landed (also after a
            # failure: late writes must not race the recomputation).
            self.ctx.compute_stream_wait(result.event)
            recving.add(request_id)
            if result.ok:
                self.stats.add("pulls_ok")
                self.stats.add("bytes_received", result.nbytes)
                self.stats.add("pull_seconds", result.seconds)
                self.stats.add("lease_wait_seconds", result.lease_wait)
                self.stats.add("load_report_seconds", time.monotonic() - result.done_at)
                self.stats.add("pulls_one_sided", int(result.one_sided))
                self.stats.add("pull_cpu_seconds", result.thread[0])
                self.stats.add("pull_runqueue_seconds", result.thread[1])
            else:
                self.stats.add("pulls_failed")
                self.stats.add_failure(result.cause)
                failed.add(request_id)
        return sending, recving, failed

    def worker_meta(self) -> PDWorkerMetadata | None:
        """First tokens of requests admitted ahead found since the last step (vLLM asks after
        get_finished: a load reported there had its token recorded before its pull began)."""
        tokens = self._ahead.take_first_tokens() if self._ahead is not None else {}
        return PDWorkerMetadata(first_tokens=tokens) if tokens else None

    def take_stats(self) -> PDTransferStats | None:
        """Counters since the last call, or None when nothing happened."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, PDTransferStats()
        return stats

    # -- consumer internals ------------------------------------------------------------------

    def _endpoint(self, lease: KVParams) -> str:
        """This rank's producer endpoint for a lease: only for params a producer of this cluster
        signed (nothing is dialed otherwise), and when the TP sizes agree."""
        if not lease.verify(self._params_key):
            raise UntrustedParamsError(
                f"kv_transfer_params naming {lease.remote_engine_id} at {list(lease.remote_endpoints)} "
                "are not signed by a prefill of this cluster: nothing dialed"
            )
        if len(lease.remote_endpoints) != self.tp_size:
            raise KVTransferError(
                f"producer {lease.remote_engine_id} has {len(lease.remote_endpoints)} "
                f"tensor-parallel ranks, this consumer has {self.tp_size}"
            )
        return lease.remote_endpoints[self.tp_rank]

    def _producer_client(self, lease: KVParams, endpoint: str) -> tuple[TransportClient, str]:
        """The verified client of the backend this consumer uses with the lease's producer at
        `endpoint` (`_endpoint(lease)`): the gRPC control handshake first (it says where the
        producer runs and what it offers)."""
        if self.faults.should_dial_unreachable():
            endpoint = "127.0.0.1:1"  # injected fault: nothing listens there
        links = self._links
        assert links is not None
        _, info = links.verified(endpoint, "grpc")
        backend = links.backend_for(endpoint, info)
        self.stats.set_backend(lease.remote_engine_id, backend)
        if backend == "grpc":
            return links.connection(endpoint, "grpc"), backend
        return links.verified(endpoint, backend)[0], backend

    def _submit_pull(self, spec: PullSpec) -> None:
        assert self._executor is not None
        with self._pending_lock:
            if spec.request_id in self._pending:
                logger.error("duplicate pull for %s ignored", spec.request_id)
                return
            if spec.remote is not None and self._messages is not None:
                self._messages.hold(spec.remote)  # renewed while it waits for a pull thread
            future = self._pending[spec.request_id] = self._executor.submit(self._pull, spec)
        future.add_done_callback(lambda _: self.waker.wake())

    def _report_failed(self, request_id: str, error: str, cause: str) -> None:
        """A load that ends without a pull, reported with the next finished ones."""
        future: Future[PullResult] = Future()
        future.set_result(PullResult(request_id, False, error=error, cause=cause))
        with self._pending_lock:
            self._pending[request_id] = future
        self.waker.wake()

    def _pull(self, spec: PullSpec) -> PullResult:
        started, clock = time.perf_counter(), ThreadClock()
        assert self._messages is not None
        try:
            return self._pull_held(spec, started, clock)
        finally:
            self._messages.drop(spec.remote)  # pulled, released or failed: no more renewals

    def _pull_held(self, spec: PullSpec, started: float, clock: ThreadClock) -> PullResult:
        # across hosts the filing time (the producer's clock) carries their clock offset
        filed = spec.remote.filed_at(self.settings.lease_seconds)
        lease_wait = max(0.0, time.time() - filed)
        faults = self.faults
        event = None
        try:
            if faults.config.pull_delay_s:
                time.sleep(faults.config.pull_delay_s)  # injected fault: a stalled consumer
            assert self._messages is not None
            endpoint = self._endpoint(spec.remote)  # params no producer of this cluster signed fail first
            if known_ended(spec.remote, self._messages.kept_until(spec.remote), time.time()):
                # The producer has freed (or is freeing) the blocks: dialing would only wait.
                ago = time.time() - spec.remote.remote_lease_expiry
                raise LeaseExpiredError(
                    f"KV lease of {spec.remote.remote_request_id} expired {ago:.1f} s ago: not pulled"
                )
            if self._messages.released(spec.remote):
                # Pulled (or failed) for another request here and let go: a request sent ahead of
                # its prefill and dropped by the router shares its lease with the one sent after
                raise LeaseExpiredError(f"KV lease of {spec.remote.remote_request_id} was released here: not pulled")
            client, _ = self._producer_client(spec.remote, endpoint)  # a layout mismatch fails here
            if len(spec.local_block_ids) != len(spec.remote_block_ids) or not spec.local_block_ids:
                raise KVTransferError(
                    f"cannot map {len(spec.remote_block_ids)} producer blocks onto "
                    f"{len(spec.local_block_ids)} local blocks"
                )
            assert self._scatterers is not None
            inject_failure = faults.should_fail_pull()
            with self._scatterers.get() as scatterer:
                scatterer.begin(spec.local_block_ids)

                def after_chunk(chunk):
                    if inject_failure:
                        raise faults.failure(spec.request_id)

                sink = CacheSink(scatterer, after_chunk)

                try:
                    nbytes = client.pull(
                        spec.remote.remote_request_id,
                        spec.remote_block_ids,
                        sink,
                        engine_id=self.engine_id,
                        timeout_s=self.settings.pull_timeout_seconds,
                        lease_expiry=spec.remote.remote_lease_expiry,  # as signed, not as renewed
                    )
                finally:
                    event = scatterer.finish()
        except Exception as exc:  # noqa: BLE001 - a pull never kills the engine: any failure is a failed load
            # Expected failures name their cause; anything else (a bug, a library's overflow) is
            # logged once with its traceback. vLLM then recomputes or fails the request.
            expected = isinstance(exc, (KVTransferError, OSError))
            logger.error(
                "KV pull for %s from %s failed: %s",
                spec.request_id,
                spec.remote.remote_engine_id,
                exc if expected else f"{type(exc).__name__}: {exc}",
                exc_info=not expected,
            )
            if self.settings.failure_policy == "fail":
                # Before vLLM hears of it: the engine's error for this request then says why.
                # under the key a request admitted ahead of its prefill is known by (ahead.py)
                reported = spec.awaiting.key if spec.awaiting is not None else spec.remote.remote_request_id
                report_failure(reported, spec.remote.remote_engine_id, str(exc))
            # Never dial what the cluster did not vouch for, nor a lease that is gone anyway.
            if not isinstance(exc, (UntrustedParamsError, LeaseExpiredError)):
                self._messages.release_later(spec.remote, False)
            return PullResult(
                spec.request_id,
                False,
                seconds=time.perf_counter() - started,
                event=event,
                error=str(exc),
                cause=failure_cause(exc),
            )
        seconds, thread = time.perf_counter() - started, clock.elapsed()  # the same window
        logger.debug("pulled %d bytes for %s in %.1f ms", nbytes, spec.request_id, seconds * 1e3)
        if faults.should_drop_release():
            logger.warning("fault injection: not releasing %s", spec.remote.remote_request_id)
        else:
            self._messages.release_later(spec.remote, True)
        result = PullResult(spec.request_id, True, nbytes, seconds, event, lease_wait=lease_wait)
        result.done_at, result.one_sided, result.thread = time.monotonic(), sink.one_sided, thread
        return result

    # -- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        colocated.unregister(self.engine_id, self)
        colocated.unregister_waker(self.waker)
        if self._ahead is not None:
            self._ahead.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._messages is not None:
            self._messages.shutdown()
        if self._links is not None:
            self._links.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
