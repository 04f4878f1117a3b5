"""The connector's scheduler half inside vLLM's own scheduler: block mapping of pulls.

A real `vllm.v1.core.sched.scheduler.Scheduler` (CPU block size 128, prefix caching on) loads
PDConnector in the scheduler role the way an engine core does; requests are vLLM `Request`s
carrying a producer's `KVParams`. No model runs: the scheduler's first step plans each pull, and
that plan (the step's PDConnectorMetadata) is what is checked: which producer blocks go into
which local blocks, after the blocks decode's own prefix cache already holds.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from types import SimpleNamespace

import pytest
import torch

from pdcluster.kv_transfer.metadata import PDConnectorMetadata
from pdcluster.kv_transfer.params import ASK_PREFILL, PULL_PLANNED, KVParams
from pdcluster.kv_transfer.settings import KVTransferSettings
from tests.support.engines import MODEL

BLOCK = 128
NUM_BLOCKS = 64
_ids = itertools.count()


def vllm_config(tmp_path, role: str):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    secret = tmp_path / "secret"
    secret.write_text("scheduler-test-secret")
    kv = KVTransferConfig(
        kv_connector="PDConnector",
        kv_connector_module_path="pdcluster.kv_transfer.connector",
        kv_role=role,
        engine_id=f"test-{role}",
        kv_connector_extra_config=KVTransferSettings(port_range=(0, 0)).connector_config(str(secret)),
    )
    args = EngineArgs(
        model=str(MODEL),
        enforce_eager=True,
        max_model_len=1024,
        block_size=BLOCK,
        enable_prefix_caching=True,
        kv_transfer_config=kv,
    )
    return args.create_engine_config()


def make_scheduler(config):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine core sets once it sized the cache
    scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(BLOCK, hash_fn)


@pytest.fixture(scope="module")
def consumer_config(tmp_path_factory):
    return vllm_config(tmp_path_factory.mktemp("consumer"), "kv_consumer")


@pytest.fixture
def consumer(consumer_config):
    return make_scheduler(consumer_config)


def request(hasher, tokens, params=None, max_tokens=4):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None)
    return Request(f"req-{next(_ids)}", list(tokens), sampling, None, block_hasher=hasher)


def lease(num_tokens, blocks) -> dict:
    return KVParams(
        remote_engine_id="prefill-0",
        remote_request_id=f"p-{next(_ids)}",
        remote_endpoints=("127.0.0.1:1",),
        remote_block_ids=tuple(blocks),
        remote_num_tokens=num_tokens,
        remote_lease_expiry=time.time() + 30,
    ).to_dict()


def step(scheduler) -> PDConnectorMetadata:
    meta = scheduler.schedule().kv_connector_metadata
    assert isinstance(meta, PDConnectorMetadata)
    return meta


def local_blocks(scheduler, req) -> list[int]:
    (group,) = scheduler.kv_cache_manager.get_blocks(req.request_id).get_block_ids()
    return group


PROMPT = list(range(1000, 1000 + 5 * BLOCK))  # token ids of a five-block prompt


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 44])
def test_every_producer_block_goes_to_the_local_block_at_its_position(consumer, length):
    scheduler, hasher = consumer
    remote = [40 + 3 * i for i in range(-(-length // BLOCK))]
    req = request(hasher, PROMPT[:length], lease(length, remote))
    scheduler.add_request(req)
    (pull,) = step(scheduler).pulls
    assert pull.request_id == req.request_id and pull.remote_block_ids == tuple(remote)
    assert pull.local_block_ids == tuple(local_blocks(scheduler, req))  # all of them, in order
    assert req.kv_transfer_params[PULL_PLANNED]


def test_blocks_in_decodes_prefix_cache_are_not_pulled(consumer):
    scheduler, hasher = consumer
    first = request(hasher, PROMPT[: 2 * BLOCK + 10])  # computed here: its two full blocks get cached
    scheduler.add_request(first)
    assert step(scheduler).pulls == []
    cached = local_blocks(scheduler, first)[:2]
    length = 4 * BLOCK + 7
    second = request(hasher, PROMPT[:length], lease(length, [50, 51, 52, 53, 54]))
    scheduler.add_request(second)
    (pull,) = step(scheduler).pulls
    blocks = local_blocks(scheduler, second)
    assert blocks[:2] == cached  # decode's own prefix-cache hit
    assert pull.remote_block_ids == (52, 53, 54) and pull.local_block_ids == tuple(blocks[2:])


def test_mtp_backoff_pulls_only_what_the_producer_computed(consumer):
    """A producer that stopped short of the prompt (MTP prefill back-off): decode pulls the
    blocks covering the computed tokens and computes the rest itself; when its prefix cache
    already covers them all, the lease is released unpulled."""
    scheduler, hasher = consumer
    length = 2 * BLOCK + 1
    short = request(hasher, PROMPT[:length], lease(2 * BLOCK - 1, [60, 61, 62]))
    scheduler.add_request(short)
    (pull,) = step(scheduler).pulls
    assert pull.remote_block_ids == (60, 61) and pull.local_block_ids == tuple(local_blocks(scheduler, short)[:2])

    other = list(range(7000, 7000 + length))
    local = request(hasher, other)  # computed here: its two full blocks get cached
    scheduler.add_request(local)
    step(scheduler)
    covered = request(hasher, other, lease(2 * BLOCK, [70, 71, 72]))  # all the producer computed
    scheduler.add_request(covered)
    meta = step(scheduler)
    assert meta.pulls == [] and [r.remote.remote_request_id for r in meta.releases] == [
        covered.kv_transfer_params["remote_request_id"]
    ]


def test_asking_for_matched_tokens_changes_nothing(consumer):
    scheduler, hasher = consumer
    req = request(hasher, PROMPT[:300], lease(300, [1, 2, 3]))
    before = copy.deepcopy(req.kv_transfer_params)
    connector = scheduler.connector
    answers = {connector.get_num_new_matched_tokens(req, computed) for computed in (0, 0, 128, 0)}
    assert answers == {(300, True), (172, True)}
    assert req.kv_transfer_params == before
    assert connector.build_connector_meta(None) == PDConnectorMetadata()  # nothing planned


def test_malformed_params_compute_locally(consumer):
    scheduler, hasher = consumer
    bad = lease(300, [1, 2, 3])
    bad["remote_block_ids"] = "1,2,3"
    req = request(hasher, PROMPT[:300], bad)
    scheduler.add_request(req)
    meta = step(scheduler)
    assert meta.pulls == [] and meta.releases == []
    assert req.kv_transfer_params[PULL_PLANNED]  # decided once
    assert req.num_computed_tokens == 300  # the whole prompt scheduled for local compute


def test_a_request_dropped_before_its_pull_releases_the_lease(consumer):
    from vllm.v1.request import RequestStatus

    scheduler, hasher = consumer
    req = request(hasher, PROMPT[:200], lease(200, [5, 6]))
    scheduler.add_request(req)
    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    meta = step(scheduler)
    assert meta.pulls == [] and len(meta.releases) == 1
    assert meta.releases[0].remote.remote_block_ids == (5, 6)


@pytest.mark.parametrize("first_token_in", [False, True], ids=["no-token-yet", "one-rank-found-it"])
def test_a_request_admitted_ahead_that_ends_is_abandoned_to_every_worker(consumer, first_token_in):
    """Tensor parallel: each rank looks the lease up on its own. When one rank found it (its
    first token is in: the request stopped awaiting here) and another gave up and had the request
    aborted, the one that gave up reports its load only once told the request ended: without
    that, vLLM waits for its report for good."""
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.metadata import PDWorkerMetadata
    from pdcluster.kv_transfer.params import AwaitParams

    scheduler, hasher = consumer
    voucher = KVParams.from_dict(lease(BLOCK, [1]))
    req = request(hasher, PROMPT[:200], AwaitParams("ab" * 16, voucher, time.time() + 30).to_dict())
    scheduler.add_request(req)
    [pull] = step(scheduler).pulls
    assert pull.awaiting is not None and pull.request_id == req.request_id
    if first_token_in:
        output = SimpleNamespace(kv_connector_worker_meta=PDWorkerMetadata({req.request_id: 7}))
        scheduler.connector.connector_scheduler.update_connector_output(output)
        assert req.prompt_token_ids[-1] == 7  # the first token became the last prompt token
    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert step(scheduler).abandoned == [req.request_id]


def test_a_request_admitted_ahead_that_ends_in_the_queue_is_forsaken_to_the_worker(consumer):
    """Ended before its blocks were allocated (no pull planned): the worker is told its key, to
    release the lease its prefill may still file."""
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.params import AwaitParams

    scheduler, hasher = consumer
    voucher = KVParams.from_dict(lease(BLOCK, [1]))
    spec = AwaitParams("cd" * 16, voucher, time.time() + 30)
    req = request(hasher, PROMPT[:200], spec.to_dict())
    scheduler.add_request(req)
    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    meta = step(scheduler)
    assert meta.pulls == [] and meta.abandoned == []
    assert [(f.request_id, f.awaiting) for f in meta.forsaken] == [(req.request_id, spec)]
    # its arrival was told too: its lease is looked up (and renewed) from then, not from its pull
    assert [(a.request_id, a.awaiting, a.local_block_ids) for a in meta.awaited] == [(req.request_id, spec, ())]


def test_producer_leases_what_it_computed(tmp_path):
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.metadata import PDHandshakeMetadata

    scheduler, hasher = make_scheduler(vllm_config(tmp_path, "kv_producer"))
    connector = scheduler.connector
    connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(endpoint="198.18.0.5:47001")})
    req = request(hasher, PROMPT[:300], dict(ASK_PREFILL), max_tokens=1)
    scheduler.add_request(req)
    step(scheduler)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = local_blocks(scheduler, req)
    keep, params = connector.request_finished(req, blocks)
    assert keep is True
    given = KVParams.from_dict(params)
    assert given.remote_block_ids == tuple(blocks) and given.remote_endpoints == ("198.18.0.5:47001",)
    assert given.remote_num_tokens == 300 and given.remote_request_id == req.request_id
    assert given.remote_lease_seconds == KVTransferSettings().lease_seconds  # how long, for the consumer
    (held,) = connector.build_connector_meta(None).new_leases
    assert held.block_ids == tuple(blocks) and abs(held.expiry_unix - given.remote_lease_expiry) < 1e-6


@pytest.mark.parametrize(
    "stop_ends, status, leased",
    [(True, "FINISHED_STOPPED", False), (False, "FINISHED_STOPPED", True), (True, "FINISHED_LENGTH_CAPPED", True)],
)
def test_a_prefill_that_stopped_where_the_router_answers_it_keeps_no_lease(tmp_path, stop_ends, status, leased):
    """A prefill request marked STOP_ENDS (the router answers a stop at token 1 from the answer)
    that stopped at its first token keeps no lease: no decode will pull it. Unmarked, or cut at
    its one token (the usual prefill), it leases its blocks."""
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.metadata import PDHandshakeMetadata
    from pdcluster.kv_transfer.params import STOP_ENDS

    scheduler, hasher = make_scheduler(vllm_config(tmp_path, "kv_producer"))
    connector = scheduler.connector
    connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(endpoint="198.18.0.5:47001")})
    req = request(hasher, PROMPT[:300], {**ASK_PREFILL, STOP_ENDS: stop_ends}, max_tokens=1)
    scheduler.add_request(req)
    step(scheduler)
    req.status = RequestStatus[status]
    keep, params = connector.request_finished(req, local_blocks(scheduler, req))
    assert (keep, params is not None) == (leased, leased)
    assert len(connector.build_connector_meta(None).new_leases) == leased


def test_a_prefill_that_stopped_for_a_request_sent_ahead_tells_its_key_that_no_lease_comes(tmp_path):
    """Under decode_ahead the decode request looks the prefill's lease up by key. A prefill that
    stopped at its first token keeps no lease (STOP_ENDS): the worker is told to answer that key
    with "none comes" (and the token), so that the lookup ends instead of running to its deadline."""
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.metadata import PDHandshakeMetadata
    from pdcluster.kv_transfer.params import LEASE_KEY, STOP_ENDS

    scheduler, hasher = make_scheduler(vllm_config(tmp_path, "kv_producer"))
    connector = scheduler.connector
    connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata(endpoint="198.18.0.5:47001")})
    req = request(hasher, PROMPT[:300], {**ASK_PREFILL, STOP_ENDS: True, LEASE_KEY: "cd" * 16}, max_tokens=1)
    scheduler.add_request(req)
    step(scheduler)
    req.append_output_token_ids(42)  # the token it stopped at (no model runs here)
    req.status = RequestStatus.FINISHED_STOPPED
    assert connector.request_finished(req, local_blocks(scheduler, req)) == (False, None)
    (spec,) = connector.build_connector_meta(None).new_leases
    assert spec.stopped and spec.key == "cd" * 16 and spec.block_ids == ()
    assert spec.first_token == 42
    # the worker half files it: a lookup of the key is answered at once, with no lease
    from tests.unit.kv_fixtures import make_worker

    settings = KVTransferSettings.from_connector_config(
        vllm_config(tmp_path, "kv_producer").kv_transfer_config.kv_connector_extra_config
    )
    worker = make_worker(settings, "test-kv_producer", producer=True)
    try:
        worker.file_leases([spec])
        assert worker.producer.handouts(["cd" * 16], 0.0) == {"cd" * 16: ("", spec.first_token)}
        assert len(worker.producer.leases) == 0  # nothing held, nothing for vLLM to free
    finally:
        worker.shutdown()


def test_a_producer_whose_worker_shares_the_process_files_its_lease_at_once(tmp_path):
    """Single-process engines: the worker half registered its producer in this process, so the
    lease is filed there when the prefill finishes; a consumer looking it up by key finds it
    before the engine schedules again, and the next step's metadata has nothing to file twice."""
    from vllm.v1.request import RequestStatus

    from pdcluster.kv_transfer.params import LEASE_KEY
    from tests.unit.kv_fixtures import make_worker

    config = vllm_config(tmp_path, "kv_producer")
    scheduler, hasher = make_scheduler(config)
    connector = scheduler.connector
    settings = KVTransferSettings.from_connector_config(config.kv_transfer_config.kv_connector_extra_config)
    worker = make_worker(settings, "test-kv_producer", producer=True)  # the scheduler half's engine id
    try:
        connector.set_xfer_handshake_metadata({0: worker.handshake_metadata()})
        key = "ab" * 16
        req = request(hasher, PROMPT[:300], {**ASK_PREFILL, LEASE_KEY: key}, max_tokens=1)
        scheduler.add_request(req)
        step(scheduler)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        keep, params = connector.request_finished(req, local_blocks(scheduler, req))
        assert keep is True
        assert worker.producer is not None
        (found,) = worker.producer.handouts([key], 0.0).values()  # no wait: filed already
        assert json.loads(found[0]) == params
        assert connector.build_connector_meta(None).new_leases == []
    finally:
        worker.shutdown()
    # once the worker is gone, a lease travels in the step's metadata again
    req = request(hasher, PROMPT[:300], dict(ASK_PREFILL), max_tokens=1)
    scheduler.add_request(req)
    step(scheduler)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert connector.request_finished(req, local_blocks(scheduler, req))[0] is True
    assert len(connector.build_connector_meta(None).new_leases) == 1


def test_a_queued_requests_lease_goes_to_the_worker_once_and_its_pull_later(consumer):
    """The worker half renews the lease of a request queued here on its own clock (not on the
    engine's steps): the scheduler hands it over once, in the step after the request arrived, and
    plans its pull when vLLM allocates its blocks."""
    scheduler, hasher = consumer
    half = scheduler.connector.connector_scheduler
    params = lease(200, [5, 6])
    scheduler.add_request(request(hasher, PROMPT[:200], params))
    meta = half.build_connector_meta(None)  # a step in which it stays queued
    assert [q.remote_request_id for q in meta.queued] == [params["remote_request_id"]]
    assert half.build_connector_meta(None).queued == []  # once
    (pull,) = step(scheduler).pulls
    assert pull.remote.remote_request_id == params["remote_request_id"]


def test_an_engine_waits_idle_only_while_every_request_waits_on_its_connector_here(consumer_config, tmp_path):
    """compat.wait_between_idle_steps asks colocated.idle_wait after each step that ran no model:
    wait (up to IDLE_WAIT_CAP_S) only when this process holds the connector's worker, to wake the
    engine, and each request waits on the connector alone: its KV loading, or finished with its
    load unreported. A request the engine could compute, or news not yet taken, means step."""
    import queue

    from vllm.v1.request import RequestStatus

    from pdcluster import compat
    from pdcluster.kv_transfer import colocated
    from tests.unit.kv_fixtures import make_worker

    scheduler, hasher = make_scheduler(consumer_config)
    inputs: queue.Queue = queue.Queue()
    awaiting = request(hasher, PROMPT[:200], lease(200, [5, 6]))
    scheduler.add_request(awaiting)
    step(scheduler)
    assert awaiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert colocated.idle_wait(scheduler, inputs) is None  # no worker here to wake it
    settings = KVTransferSettings.from_connector_config(consumer_config.kv_transfer_config.kv_connector_extra_config)
    worker = make_worker(settings, "test-waker", producer=True)
    try:
        assert colocated.idle_wait(scheduler, inputs) == colocated.IDLE_WAIT_CAP_S
        computable = request(hasher, PROMPT[:40])
        scheduler.add_request(computable)
        assert colocated.idle_wait(scheduler, inputs) is None
        scheduler.finish_requests(computable.request_id, RequestStatus.FINISHED_ABORTED)
        scheduler.finish_requests(awaiting.request_id, RequestStatus.FINISHED_ABORTED)
        assert colocated.idle_wait(scheduler, inputs) is None  # finished ids the workers must hear of
        step(scheduler)
        assert awaiting.request_id in scheduler.requests  # blocks kept until its load is reported
        assert colocated.idle_wait(scheduler, inputs) == colocated.IDLE_WAIT_CAP_S
        # the worker wakes the waiting engine when a lease it holds ends
        assert worker.producer is not None and inputs.empty()
        worker.producer.leases.add("p-1", [1, 2], time.monotonic() + 30)
        assert worker.producer.leases.release("p-1", transferred=True)
        assert inputs.get_nowait() == compat.wakeup_item()
    finally:
        worker.shutdown()
    assert colocated.idle_wait(scheduler, inputs) is None


def test_a_wake_up_before_the_engine_first_waited_is_kept_for_it():
    import queue

    from pdcluster import compat
    from pdcluster.kv_transfer.colocated import EngineWaker

    waker, inputs = EngineWaker(), queue.Queue()
    waker.wake()  # a pull finished before the engine ever waited
    waker.attach(inputs)
    assert inputs.get_nowait() == compat.wakeup_item() and inputs.empty()
    waker.attach(inputs)  # the same queue again: nothing new
    assert inputs.empty()
    waker.wake()
    assert inputs.get_nowait() == compat.wakeup_item()


def test_a_lease_filed_in_this_process_wakes_its_waiting_consumer_once_the_steps_outputs_are_queued(monkeypatch):
    """The scheduler half files a lease with the worker in its process at once (a pull finds it),
    but the handout lookup already waiting for it (a gRPC thread of this process) is woken only
    when the engine core has queued that step's outputs (colocated.outputs_queued, called after
    every step): woken earlier it ran ahead of the engine thread, on its core, between the
    prefill's first token and its output. Before the engine's step hook ever ran, the lease wakes it at once."""
    import threading

    from pdcluster.kv_transfer import colocated
    from pdcluster.kv_transfer.metadata import LeaseSpec
    from tests.unit.kv_fixtures import make_worker

    monkeypatch.setattr(colocated, "_steps_hooked", False)
    worker = make_worker(KVTransferSettings(secret="colocated-test"), "test-outputs-queued", producer=True)
    assert worker.producer is not None
    leases = worker.producer.leases
    found: list[dict] = []

    def waiting(key: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: found.append(leases.handouts([key], wait_s=60)), daemon=True)
        thread.start()
        end = time.monotonic() + 10
        while not leases._cond._waiters:  # CPython's Condition: the lookup is waiting on it
            assert time.monotonic() < end, "the lookup never waited"
            time.sleep(0.005)  # poll interval
        return thread

    def spec(n: int) -> LeaseSpec:
        return LeaseSpec(f"p-{n}", (n,), time.time() + 30, key=f"k-{n}", params="{}", first_token=n)

    try:
        lookup = waiting("k-1")  # no engine step hook yet: woken at once
        assert colocated.file_lease("test-outputs-queued", spec(1))
        lookup.join(10)
        assert found == [{"k-1": ("{}", 1)}]

        colocated.outputs_queued()  # the engine core's first step ended
        lookup = waiting("k-2")
        assert colocated.file_lease("test-outputs-queued", spec(2))
        assert leases.handouts(["k-2"]) == {"k-2": ("{}", 2)}  # filed at once
        lookup.join(0.5)
        assert lookup.is_alive(), "the waiting lookup was woken before the step's outputs were queued"
        colocated.outputs_queued()
        lookup.join(10)
        assert found[1:] == [{"k-2": ("{}", 2)}]
        assert not colocated.file_lease("another-engine", spec(3))  # its worker runs elsewhere
    finally:
        worker.shutdown()
