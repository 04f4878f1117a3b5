"""The connector's worker half as a consumer, against a real producer's KV server: whatever goes
wrong inside a pull (a bug, bad block ids, a lease known to be over) is a failed load reported to
vLLM, never an exception that would kill the engine."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer.metadata import PDConnectorMetadata, PullSpec, ReleaseSpec
from pdcluster.kv_transfer.params import KVParams
from pdcluster.kv_transfer.producer import KVProducer
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.stats import ThreadClock
from pdcluster.kv_transfer.transports import create_transport
from pdcluster.kv_transfer.worker import ConnectorWorker
from tests.unit.kv_fixtures import make_cache, make_worker

SECRET = "worker-test-secret"
SETTINGS = KVTransferSettings(secret=SECRET, backend="grpc", max_chunk_bytes=4096, pull_timeout_seconds=10)


@pytest.fixture
def producer():
    producer = KVProducer(make_cache(seed=3), "prefill-0", max_chunk_bytes=4096, lease_wait_s=1)
    server = create_transport("grpc", SETTINGS).serve(producer, "127.0.0.1", 0)
    yield producer, server.address
    server.stop(0)


@pytest.fixture
def consumer():
    worker = make_worker(SETTINGS, "decode-0", producer=False, fill="zeros")
    yield worker
    worker.shutdown()


def lease(
    endpoint: str, blocks=(4, 5), expiry_in: float = 600, request_id: str = "req-1", lease_seconds: float = 0.0
) -> KVParams:
    return KVParams(
        remote_engine_id="prefill-0",
        remote_request_id=request_id,
        remote_endpoints=(endpoint,),
        remote_block_ids=tuple(blocks),
        remote_num_tokens=16 * len(blocks),
        remote_lease_expiry=time.time() + expiry_in,
        remote_lease_seconds=lease_seconds,
    ).signed(derive_key(SECRET, KV_PARAMS))


def outcome(worker: ConnectorWorker, spec: PullSpec) -> str:
    worker.bind(PDConnectorMetadata(pulls=[spec]))
    return finished(worker, spec)[spec.request_id]


def finished(worker: ConnectorWorker, *specs: PullSpec) -> dict[str, str]:
    """How the pulls already handed to `worker` ended ("ok" or "failed"), once all have."""
    ended: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, recving, failed = worker.get_finished()  # must never raise
        ended.update({rid: "failed" if rid in failed else "ok" for rid in recving})
        if all(spec.request_id in ended for spec in specs):
            return ended
        time.sleep(0.01)  # poll interval
    raise AssertionError(f"pulls never finished: {[s.request_id for s in specs if s.request_id not in ended]}")


def released(producer: KVProducer) -> list[str]:
    """The leases the producer saw end, once one has (releases run on the consumer's control pool)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if done := producer.leases.collect_finished():
            return [lease.request_id for lease in done]
        time.sleep(0.01)  # poll interval
    return []


def test_a_good_pull_lands(producer, consumer):
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    spec = PullSpec("d-1", lease(address), (4, 5), (0, 1))
    assert outcome(consumer, spec) == "ok"


@pytest.mark.parametrize("producer_lease_seconds", [0.0, 600.0], ids=["params-silent", "producer-says"])
def test_a_pull_times_the_handoff_stages_around_it(producer, consumer, producer_lease_seconds):
    """A lease filed 2 s before its pull: the wait before the pull is counted from the filing
    (the lease's expiry less the producer's lease_seconds, or the consumer's where its params do
    not say), the report after it from the last byte."""
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    lasts = producer_lease_seconds or SETTINGS.lease_seconds
    given = lease(address, expiry_in=lasts - 2, lease_seconds=producer_lease_seconds)
    spec = PullSpec("d-1", given, (4, 5), (0, 1))
    assert outcome(consumer, spec) == "ok"
    stats = consumer.take_stats().data
    assert stats["pulls_ok"] == 1
    assert 2 <= stats["lease_wait_seconds"] < 2 + 30  # the pull's own deadline bounds the rest
    assert 0 < stats["load_report_seconds"] < 30
    # the pull's thread: on a CPU for part of the pull, never longer than the pull (1 ms: clocks)
    assert 0 < stats["pull_cpu_seconds"]
    assert stats["pull_cpu_seconds"] + stats["pull_runqueue_seconds"] <= stats["pull_seconds"] + 1e-3


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel keeps no schedstat")
def test_a_thread_clock_tells_cpu_time_from_waiting_for_a_cpu():
    """This thread spinning on a CPU that another process spins on too: it runs part of the
    time and waits for the CPU the rest; sleeping, it does neither (a machine busy with other work
    can only make it wait for a CPU once it woke)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}}); print(flush=True)\nwhile True: pass"
    rival = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})  # the calling thread only
        rival.stdout.readline()  # pinned, and spinning from now on
        clock, began = ThreadClock(), time.thread_time()
        while time.thread_time() - began < 0.1:
            pass
        on_cpu, waiting = clock.elapsed()
    finally:
        os.sched_setaffinity(0, mask)
        rival.kill()
        rival.wait()
    assert on_cpu >= 0.09
    assert waiting >= 0.03  # the rival ran meanwhile: as long again when the CPU is shared fairly

    # Asleep it neither runs nor waits for a CPU; woken, it may wait for one as long as the
    # machine makes it (only that: the wall time past the sleep bounds it).
    sleeper, began = ThreadClock(), time.monotonic()
    time.sleep(0.05)
    on_cpu, waiting = sleeper.elapsed()
    wall = time.monotonic() - began
    assert on_cpu < 0.02 and waiting <= wall - 0.05 + 1e-3


def test_local_block_ids_outside_the_cache_are_a_failed_load(producer, consumer):
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    spec = PullSpec("d-2", lease(address), (4, 5), (0, 10**9))
    assert outcome(consumer, spec) == "failed"
    assert consumer.take_stats().data["pull_failures"] == {"handshake": 1}  # a layout-level error
    # The producer's lease is released all the same (on the pull pool: after the load's report).
    assert released(source) == ["req-1"]


def test_a_bug_inside_the_transport_is_a_failed_load(producer, consumer, monkeypatch, caplog):
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    from pdcluster.kv_transfer.transports.grpc_transport import GrpcClient

    def broken(self, *args, **kwargs):
        raise ZeroDivisionError("a transport bug")

    monkeypatch.setattr(GrpcClient, "pull", broken)
    with caplog.at_level("ERROR", logger="pdcluster.kv_transfer.worker"):
        assert outcome(consumer, PullSpec("d-3", lease(address), (4, 5), (0, 1))) == "failed"
    errors = [r for r in caplog.records if "ZeroDivisionError: a transport bug" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None  # once, with its traceback
    assert consumer.take_stats().data["pull_failures"] == {"internal": 1}


def test_a_lease_known_to_have_expired_is_not_pulled(consumer):
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(4)
        trap.setblocking(False)
        expired = lease(f"127.0.0.1:{trap.getsockname()[1]}", expiry_in=-5)
        assert outcome(consumer, PullSpec("d-4", expired, (4, 5), (0, 1))) == "failed"
        assert consumer.take_stats().data["pull_failures"] == {"lease_expired": 1}
        with pytest.raises(BlockingIOError):
            trap.accept()  # neither a pull nor a release was dialed


def test_params_no_producer_signed_are_refused_as_such_even_past_their_expiry(consumer):
    """A forged lease is refused for what it is (not signed: nothing dialed) whatever its expiry
    says; one that also claimed an expiry in the past once failed as an expired lease."""
    forged = KVParams(**{**lease("127.0.0.1:1", expiry_in=-5).__dict__, "signature": "00" * 32})
    assert outcome(consumer, PullSpec("d-5", forged, (4, 5), (0, 1))) == "failed"
    assert consumer.take_stats().data["pull_failures"] == {"untrusted_params": 1}


def test_a_lease_released_here_is_never_pulled_again(consumer):
    """A lease this consumer pulled and let go is not pulled again for another request (a request
    sent ahead of its prefill and dropped by the router shares its lease with the one sent after
    it): its blocks may be another request's by then, which a one-sided read (shm) would not
    notice. The second pull fails as a lease over, without dialing the producer (stopped here:
    dialed, it would fail as unreachable)."""
    source = KVProducer(make_cache(seed=3), "prefill-0", max_chunk_bytes=4096, lease_wait_s=1)
    server = create_transport("grpc", SETTINGS).serve(source, "127.0.0.1", 0)
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    held = lease(server.address)
    try:
        assert outcome(consumer, PullSpec("d-1", held, (4, 5), (0, 1))) == "ok"
        assert released(source) == ["req-1"]
    finally:
        server.stop(0)
    consumer.take_stats()
    assert outcome(consumer, PullSpec("d-2", held, (4, 5), (2, 3))) == "failed"
    assert consumer.take_stats().data["pull_failures"] == {"lease_expired": 1}


def test_queued_leases_are_renewed_without_engine_steps_until_released(producer, consumer):
    """The scheduler names a queued request's lease once; the worker renews it on its own clock
    every sixth of the producer's lease (3 s here, this consumer's setting 30 s) while the engine
    takes no step, for three leases' time (before, renewals went out only at the engine's steps:
    an engine core that stalled past a lease let its queued leases expire). A lease no producer of
    the cluster signed is never renewed; a released one no longer is."""
    source, address = producer
    # 3 s: a renewal every 0.5 s, so only a stall of this process over 2.5 s could expire it
    source.lease_seconds = 3  # what a renewal extends a lease to
    source.leases.add("req-1", [4, 5], time.monotonic() + 3)
    queued = lease(address, expiry_in=3, lease_seconds=3)
    forged = KVParams(**{**lease(address, expiry_in=3).__dict__, "remote_request_id": "req-2", "signature": "00" * 32})
    forged_deadline = time.monotonic() + 600
    source.leases.add("req-2", [6], forged_deadline)
    consumer.bind(PDConnectorMetadata(queued=[queued, forged]))  # one step, then none
    end = time.monotonic() + 9
    while time.monotonic() < end:
        assert not source.leases.collect_finished(), "a queued lease expired between engine steps"
        time.sleep(0.1)  # poll interval
    assert source.leases._leases["req-2"].deadline == forged_deadline  # forged: not renewed
    assert consumer._messages.kept_until(queued) > time.time()
    consumer.bind(PDConnectorMetadata(releases=[ReleaseSpec(queued, "request FINISHED_ABORTED")]))
    assert released(source) == ["req-1"]
    assert consumer._messages.kept_until(queued) == 0.0  # no longer renewed


def test_a_kept_lease_whose_renewal_runs_late_is_renewed_and_pulled_not_taken_for_ended(producer, consumer):
    """Renewals held up past their own estimate of a lease's end (this process not scheduled) still
    renew it, and its pull dials the producer, which holds it until a renewal reached it plus its
    lease. Before, the keeper took the lease for ended and let it go, and its pull was refused as
    expired while the producer still held it (a clean-clone run: "KV lease of req-2 expired 4.4 s
    ago: not pulled" in test_a_pull_waiting_for_a_pull_thread_keeps_its_lease)."""
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    kept = lease(address, expiry_in=1.2, lease_seconds=1.2)
    consumer.bind(PDConnectorMetadata(queued=[kept]))
    wait_for_renewal = time.monotonic() + 30
    while not (first := consumer._messages.kept_until(kept)):
        assert time.monotonic() < wait_for_renewal, "never renewed"
        time.sleep(0.01)  # poll interval
    with consumer._messages._cond:  # the keeper cannot run past its estimate of the lease's end
        time.sleep(max(0.0, first - time.time()) + 0.5)
    while consumer._messages.kept_until(kept) <= first:
        assert time.monotonic() < wait_for_renewal, "the late renewal never went out: the lease was let go"
        time.sleep(0.01)  # poll interval
    assert outcome(consumer, PullSpec("d-1", kept, (4, 5), (0, 1))) == "ok"


def test_renewals_that_run_late_say_so(producer, consumer, caplog):
    """Renewals wait on nothing but their own thread: when they run a couple of periods late, the
    log says so (what an expired lease would otherwise leave unsaid), and how much of the delay the
    thread waited for a CPU: here it was held up in its own process (a lock), so not all of it."""
    source, address = producer
    source.leases.add("req-1", [4, 5], time.monotonic() + 600)
    with caplog.at_level("WARNING", logger="pdcluster.kv_transfer.lease_messages"):
        consumer.bind(PDConnectorMetadata(queued=[lease(address, expiry_in=1.2, lease_seconds=1.2)]))
        with consumer._messages._cond:  # the keeper cannot run: 0.2 s periods, 1 s without
            time.sleep(1)
        deadline = time.monotonic() + 30
        while not (late := [r.getMessage() for r in caplog.records if "late" in r.getMessage()]):
            assert time.monotonic() < deadline, "no warning"
            time.sleep(0.01)  # poll interval
    found = re.search(r"ran ([\d.]+) s late: this thread waited ([\d.]+) s of it for a CPU", late[0])
    assert found, late[0]
    assert float(found.group(2)) < float(found.group(1)) >= 0.4, late[0]
    # and what the machine's kernel saw meanwhile, where it keeps pressure stalls
    stalls = r"cpu \d+% memory \d+% io \d+%" if os.path.exists("/proc/pressure/io") else "not kept"
    assert re.search("machine stalls over 10 s: " + stalls, late[0]), late[0]


def test_a_release_after_shutdown_is_left_to_the_lease_expiry(producer, consumer):
    """Releases go to the control pool; a pull that ends while the worker shuts down must not raise
    from there (its lease expires on the producer instead)."""
    _, address = producer
    consumer.shutdown()
    consumer._messages.release_later(lease(address), True)  # the pool refuses new work: logged, not raised


def test_releases_and_renewals_do_not_queue_behind_a_stalled_pull():
    """The only pull thread waits on the producer (the pull's lease is not filed yet): a release
    and a renewal still reach the producer meanwhile (they queued behind the pull before: the
    stall held the released blocks and let queued requests' leases expire)."""
    settings = SETTINGS.model_copy(update={"pull_threads": 1, "pull_timeout_seconds": 60})
    source = KVProducer(make_cache(seed=3), "prefill-0", max_chunk_bytes=4096, lease_wait_s=60)
    source.lease_seconds = 600
    server = create_transport("grpc", settings).serve(source, "127.0.0.1", 0)
    worker = make_worker(settings, "decode-0", producer=False, fill="zeros")
    try:
        address = server.address
        source.leases.add("req-2", [6], time.monotonic() + 1)  # queued on decode: to be renewed
        source.leases.add("req-3", [7], time.monotonic() + 600)  # hit decode's cache: released
        stalled = PullSpec("d-1", lease(address), (4, 5), (0, 1))  # req-1: filed only below
        renewal = lease(address, (6,), 3, "req-2", 3)  # renewed every half second
        unpulled = KVParams(**{**lease(address).__dict__, "remote_request_id": "req-3"}).signed(
            derive_key(SECRET, KV_PARAMS)
        )
        worker.bind(PDConnectorMetadata(pulls=[stalled]))
        worker.bind(PDConnectorMetadata(queued=[renewal], releases=[ReleaseSpec(unpulled, "local cache hit")]))
        deadline = time.monotonic() + 20  # well inside the stalled pull's 60 s wait
        while source.leases._leases["req-2"].deadline < time.monotonic() + 100:
            assert time.monotonic() < deadline, "the renewal waited behind the stalled pull"
            time.sleep(0.01)  # poll interval
        assert released(source) == ["req-3"]
        assert "d-1" not in worker.get_finished()[1]  # the pull still waits
        source.leases.add("req-1", [4, 5], time.monotonic() + 600)
        assert finished(worker, stalled) == {"d-1": "ok"}
    finally:
        worker.shutdown()
        server.stop(0)


def test_a_renewal_does_not_queue_behind_releases_to_a_producer_that_does_not_answer(producer):
    """Releases to a producer that takes connections and never answers hold every release thread
    (up to their deadline, a minute here); a queued lease of another producer is renewed meanwhile.
    Before, renewals shared those threads and waited behind the releases, past short leases."""
    source, address = producer
    source.lease_seconds = 600  # what a renewal extends a lease to
    settings = SETTINGS.model_copy(update={"release_timeout_seconds": 60, "connect_timeout_seconds": 60})
    worker = make_worker(settings, "decode-0", producer=False, fill="zeros")
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel takes connections; nothing answers
    try:
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        releases = [ReleaseSpec(lease(mute, request_id=f"req-{i}"), "local cache hit") for i in range(7, 11)]
        worker.bind(PDConnectorMetadata(releases=releases))
        source.leases.add("req-2", [6], time.monotonic() + 1)
        worker.bind(PDConnectorMetadata(queued=[lease(address, (6,), 3, "req-2", 3)]))  # every half second
        deadline = time.monotonic() + 20  # well inside the releases' minute
        while source.leases._leases["req-2"].deadline < time.monotonic() + 100:
            assert time.monotonic() < deadline, "the renewal waited behind the releases"
            time.sleep(0.01)  # poll interval
    finally:
        silent.close()  # the releases' connections are reset: they end
        worker.shutdown()


@pytest.mark.parametrize(
    ("consumer_lease_s", "producer_lease_s"), [(6, 6), (30, 2)], ids=["same-lease", "producer-shorter"]
)
def test_a_pull_waiting_for_a_pull_thread_keeps_its_lease(consumer_lease_s, producer_lease_s):
    """The only pull thread waits on the producer (its lease is not filed yet) past the lease of
    the pull queued behind it: the consumer renews that lease while it waits (the engine takes no
    step meanwhile), and its pull then lands (it expired before: a failed load, the prefill
    recomputed). Also where the producer's leases are shorter than the consumer's setting (renewed
    every sixth of the producer's; before its params said how long, every 5 s, after the lease
    was over)."""
    settings = SETTINGS.model_copy(
        update={"pull_threads": 1, "pull_timeout_seconds": 60, "lease_seconds": consumer_lease_s}
    )
    source = KVProducer(
        make_cache(seed=3), "prefill-0", max_chunk_bytes=4096, lease_wait_s=60, lease_seconds=producer_lease_s
    )
    server = create_transport("grpc", settings).serve(source, "127.0.0.1", 0)
    worker = make_worker(settings, "decode-0", producer=False, fill="zeros")
    try:
        address = server.address
        said = producer_lease_s if producer_lease_s != consumer_lease_s else 0.0  # the old params' case too
        first = PullSpec("d-1", lease(address, lease_seconds=said), (4, 5), (0, 1))  # req-1: filed only below
        unrenewed = producer_lease_s / 2
        second = PullSpec("d-2", lease(address, (6,), unrenewed, "req-2", said), (6,), (2,))
        source.leases.add("req-2", [6], time.monotonic() + unrenewed)
        worker.bind(PDConnectorMetadata(pulls=[first, second]))
        deadline = time.monotonic() + 4 * unrenewed
        while time.monotonic() < deadline:
            assert not source.leases.collect_finished(), "req-2's lease expired while its pull waited"
            time.sleep(0.1)  # poll interval
        source.leases.add("req-1", [4, 5], time.monotonic() + 600)
        assert finished(worker, first, second) == {"d-1": "ok", "d-2": "ok"}
    finally:
        worker.shutdown()
        server.stop(0)
