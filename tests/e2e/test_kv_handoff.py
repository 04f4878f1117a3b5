"""P -> D handoff through PDConnector with real vLLM engines in separate processes, driven over
HTTP as the router drives them (prefill: max_tokens=1, do_remote_decode; decode: the returned
params). Float32, strict identity of tokens and logprobs (tests/support/identity.py; bf16 in
test_bf16_identity.py). Engines: the aggregated reference (conftest.py), one prefill (backend
auto: offers grpc, shm, mooncake, collective) and decodes: grpc (the full matrix), auto (shm on
one node; vLLM's own worker-process layout, the others single-process), collective (gloo),
mooncake (TCP; one request at a time, so a second queues: lease renewal), one whose every pull
fails (recompute policy) and one whose layout does not match (block size 64; fail policy).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.colocated import IDLE_WAIT_CAP_S
from pdcluster.kv_transfer.params import KVParams
from tests.support.engines import (
    MAX_MODEL_LEN,
    assert_engine_key_required,
    run_engines,
    thread_cores,
    tiny_engine,
    vllm_processes,
)
from tests.support.handoff import NAME, complete, greedy, handoff, info, through_router, wait_for
from tests.support.identity import Greedy, assert_same_greedy, compare
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU default block size
LEASE_S = 10
DTYPE = "float32"


def spec(
    engine_id,
    role,
    bind,
    secret_file,
    *,
    policy="recompute",
    kv=None,
    single_process=True,
    scope="engine",
    **engine_args,
):
    return tiny_engine(
        engine_id,
        role,
        dtype=DTYPE,
        secret_file=secret_file,
        kv={"failure_policy": policy, **(kv or {})},
        engine_args={"max_num_seqs": 16, **engine_args},
        cpu_threads_bind=bind,
        single_process=single_process,
        cpu_bind_scope=scope,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory, reference_engine):
    tmp = tmp_path_factory.mktemp("kv-handoff")
    secret = tmp / "secret"
    secret.write_text("handoff-test-secret\n")
    specs = [
        # Bound beyond loopback, so auto also offers mooncake (Mooncake listens on every interface).
        spec(
            "prefill",
            "prefill",
            "0",
            secret,
            kv={"lease_seconds": LEASE_S, "backend": "auto", "bind_host": "0.0.0.0", "advertise_host": "127.0.0.1"},
        ),
        # every thread of it on core 1 (cpu_bind_scope replica); the others bind their engine thread
        spec("decode", "decode", "1", secret, scope="replica"),
        # vLLM's own CPU layout (a worker process holds the model); the others run single-process
        spec("decode-shm", "decode", "1", secret, kv={"backend": "auto"}, single_process=False),
        spec("decode-collective", "decode", "1", secret, kv={"backend": "collective"}),
        # one request at a time: a second one queues (lease renewal)
        spec("decode-mooncake", "decode", "1", secret, kv={"backend": "mooncake"}, max_num_seqs=1),
        spec("decode-faulty", "decode", "1", secret, kv={"fault_injection": {"pull_failure_rate": 1.0}}),
        spec("decode-mismatch", "decode", "1", secret, policy="fail", block_size=64),
    ]
    with run_engines(specs, tmp) as running:
        yield {"agg": reference_engine, **running}


def assert_same(expected: Greedy, response: httpx.Response, what: str = "") -> None:
    assert_same_greedy(expected, greedy(response), DTYPE, what)


# Prompt lengths in tokens: 1 token, exactly one block, one block + 1, many blocks, near
# max_model_len (which leaves room for the 8 generated tokens).
LENGTHS = [
    1,
    2,
    17,
    BLOCK - 1,
    BLOCK,
    BLOCK + 1,
    2 * BLOCK,
    3 * BLOCK + 5,
    5 * BLOCK + 64,
    MAX_MODEL_LEN - 9,
    MAX_MODEL_LEN - 8,
]


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_output_matches_aggregated(engines, length):
    prompt = token_prompt(length, offset=length * 7)
    expected = greedy(complete(engines["agg"], prompt, 8))
    response, params = handoff(engines["prefill"], engines["decode"], prompt, 8)
    assert_same(expected, response)
    assert params["remote_num_tokens"] == length
    assert len(params["remote_block_ids"]) == -(-length // BLOCK)


# The second handoff of a prompt finds its full blocks in decode's own prefix cache: only the
# rest is pulled, from the producer blocks at the same positions.
@pytest.mark.parametrize("length", [BLOCK + 60, 4 * BLOCK + 60])
def test_decode_prefix_cache_hit_pulls_only_the_rest(engines, length):
    prompt = token_prompt(length, offset=4242 + length)
    expected = greedy(complete(engines["agg"], prompt, 8))
    start = info(engines["decode"])["stats"]
    first, _ = handoff(engines["prefill"], engines["decode"], prompt, 8)
    middle = info(engines["decode"])["stats"]
    second, _ = handoff(engines["prefill"], engines["decode"], prompt, 8)
    end = info(engines["decode"])["stats"]
    assert_same(expected, first, "first handoff")
    assert_same(expected, second, "second handoff (prefix-cache hit)")
    assert end["kv_pulls_ok"] - middle["kv_pulls_ok"] == middle["kv_pulls_ok"] - start["kv_pulls_ok"] == 1
    blocks = -(-length // BLOCK)
    whole = middle["kv_bytes_received"] - start["kv_bytes_received"]
    assert end["kv_bytes_received"] - middle["kv_bytes_received"] == whole // blocks  # the last block


def test_concurrent_batch_matches_aggregated(engines):
    prompts = [token_prompt(60 + 37 * i, offset=1000 + 211 * i) for i in range(12)]
    expected = [greedy(complete(engines["agg"], p, 12)) for p in prompts]
    before = info(engines["decode"])["stats"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: handoff(engines["prefill"], engines["decode"], p, 12)[0], prompts))
    for i, (want, got) in enumerate(zip(expected, results)):
        assert_same(want, got, f"prompt {i}")
    after = wait_for(
        lambda: (s := info(engines["decode"])["stats"])["kv_pulls_ok"] >= before["kv_pulls_ok"] + 12 and s,
        30,
        "decode pull counters",
    )
    assert after["kv_pulls_failed"] == before["kv_pulls_failed"]
    assert after["kv_bytes_received"] > before["kv_bytes_received"]


def test_chat_and_text_prompts_hand_off(engines):
    text = "def fibonacci(n):\n    "
    reference = complete(engines["agg"], text, 16)
    response, _ = handoff(engines["prefill"], engines["decode"], text, 16)
    assert_same(greedy(reference), response)
    assert response.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_corrupt_kv_fails_the_identity_check(engines):
    """The check above would catch corrupt KV: decode pulls the producer's block 0 twice, into
    its blocks 0 and 1 (real KV of the same prompt, in the wrong place), and its logprobs leave
    the float32 bound at once, whatever tokens it happens to pick. (Swapping two blocks would not
    do: keys carry their rotary positions, and attention over a set of keys ignores which slot
    holds which. No other test's prompt starts where this one does, so decode's prefix cache
    never serves these blocks to another.) The altered params are signed again with the cluster's
    key, as a faulty producer of this cluster would hand them out: unsigned, decode would not pull
    them at all."""
    prompt = token_prompt(3 * BLOCK + 20, offset=7919)
    expected = greedy(complete(engines["agg"], prompt, 8))
    first = complete(engines["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True})
    lease = KVParams.from_dict(first.json()["kv_transfer_params"])
    blocks = lease.remote_block_ids
    lease = replace(lease, remote_block_ids=(blocks[0], blocks[0], *blocks[2:]))
    params = lease.signed(derive_key(engines["decode"].secret, KV_PARAMS)).to_dict()
    corrupt = greedy(complete(engines["decode"], prompt, 8, kv_transfer_params=params))
    verdict = compare(expected, corrupt)
    with pytest.raises(AssertionError, match="drift|not a near-tie"):
        assert_same_greedy(expected, corrupt, DTYPE)
    print(f"block 0 pulled twice: {verdict.describe()}")


def test_a_seeded_request_gives_one_engines_text_on_every_call(engines):
    """Sampling with a seed through P/D (the classic path the router takes for it: decode samples
    every token from the seed) is reproducible and equals one engine's. Without MTP: with it,
    vLLM 0.32's CPU spec-decode sampling is not reproducible even on one engine (model card)."""
    prompt = token_prompt(2 * BLOCK + 30, offset=4242)
    seeded = {"temperature": 0.8, "seed": 1234, "ignore_eos": True}
    expected = complete(engines["agg"], prompt, 24, **seeded).json()["choices"][0]["text"]
    texts = {
        handoff(engines["prefill"], engines["decode"], prompt, 24, **seeded)[0].json()["choices"][0]["text"]
        for _ in range(2)
    }
    streamed, _ = handoff(engines["prefill"], engines["decode"], prompt, 24, stream=True, **seeded)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    texts.add("".join(c["text"] for e in events for c in e["choices"]))
    assert texts == {expected}


def test_a_lease_outlives_a_long_queue_at_decode(engines):
    """A decode engine busy with long requests (one at a time) holds a handed-over request queued
    for longer than the prefill's lease: its renewals keep the lease, so the pull succeeds
    (nothing expires, nothing is recomputed). The busy work grows until the queue outlasts the
    lease on this machine."""
    narrow, prefill = engines["decode-mooncake"], engines["prefill"]
    busy_requests = 2
    for _ in range(4):
        before_d = info(narrow)["stats"]
        with ThreadPoolExecutor(busy_requests) as pool:
            busy = [pool.submit(complete, narrow, token_prompt(8, offset=90 + i), 1000) for i in range(busy_requests)]
            wait_for(lambda n=busy_requests: info(narrow)["stats"]["waiting"] == n - 1, 60, "a busy queue")
            started = time.monotonic()
            response, _ = handoff(prefill, narrow, token_prompt(2 * BLOCK + 7, offset=515), 4)
            queued_s = time.monotonic() - started
            assert all(f.result().status_code == 200 for f in busy)
        assert response.status_code == 200, response.text
        if queued_s > LEASE_S:
            break
        busy_requests = math.ceil(busy_requests * 1.5 * LEASE_S / queued_s)  # a longer queue next time
    assert queued_s > LEASE_S, f"the queue ({queued_s:.1f} s) never outlasted the lease ({LEASE_S} s)"
    # The queued request's pull succeeded, so its lease was alive when pulled. (The prefill's own
    # expiry count is no witness: it serves every decode of this module, and a lease an earlier
    # test left to expire can run out inside this window on a loaded machine.)
    after_d = info(narrow)["stats"]
    assert after_d["kv_pulls_ok"] == before_d["kv_pulls_ok"] + 1
    assert after_d["kv_pulls_failed"] == before_d["kv_pulls_failed"]


def test_producer_blocks_are_freed_after_every_handoff(engines):
    prefill = engines["prefill"]
    handoff(prefill, engines["decode"], token_prompt(300, offset=5), 4)
    stats = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, 30, "P blocks freed")
    assert stats["kv_leases_released"] >= 1


def test_injected_pull_failure_recomputes_same_output(engines):
    prompt = token_prompt(3 * BLOCK + 11, offset=333)
    expected = greedy(complete(engines["agg"], prompt, 10))
    before = info(engines["decode-faulty"])["stats"]["kv_pulls_failed"]
    response, _ = handoff(engines["prefill"], engines["decode-faulty"], prompt, 10)
    assert_same(expected, response)
    assert info(engines["decode-faulty"])["stats"]["kv_pulls_failed"] == before + 1
    # The failed consumer released the lease: P's blocks are free again.
    wait_for(lambda: info(engines["prefill"])["stats"]["kv_cache_usage"] == 0.0, 30, "P blocks freed")


def test_lease_expiry_frees_blocks_when_decode_never_pulls(engines):
    prefill = engines["prefill"]
    baseline = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, 30, "idle P")
    first = complete(prefill, token_prompt(4 * BLOCK, offset=77), 1, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200
    held = info(prefill)["stats"]
    assert held["kv_cache_usage"] > 0.0  # blocks kept for a decode that never comes
    after = wait_for(
        lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s,
        LEASE_S + 20,
        "lease expiry",
    )
    assert after["kv_leases_expired"] == baseline["kv_leases_expired"] + 1


def test_layout_mismatch_fails_request_with_naming_error(engines):
    prompt = token_prompt(200, offset=42)
    response, _ = handoff(engines["prefill"], engines["decode-mismatch"], prompt, 4)
    # fail policy: the request errors out instead of being silently recomputed ...
    failed = response.status_code != 200 or response.json()["choices"][0]["finish_reason"] == "error"
    assert failed, response.text
    # ... and the decode engine says exactly what does not match, naming both sides.
    log = Path(engines["decode-mismatch"].log_path).read_text(errors="replace")
    assert "KV layout mismatch on block_size" in log
    assert "has 128" in log and "has 64" in log
    # The producer's blocks are released all the same.
    wait_for(lambda: info(engines["prefill"])["stats"]["kv_cache_usage"] == 0.0, 30, "P blocks freed")


# -- security: engine ports take only the cluster's requests; decode dials only what P signed --


@pytest.mark.parametrize("name", ["agg", "prefill", "decode"])
def test_every_engine_port_requires_the_engine_key(engines, name):
    engine = engines[name]
    assert_engine_key_required(engine.url, engine.headers)


def test_forged_params_dial_nothing_and_are_recomputed_or_refused(engines):
    """Params a prefill signed, pointed at another endpoint (or stripped of the signature), make
    decode dial nothing: recomputed under `recompute`, a 502 naming why under `fail`."""
    prompt = token_prompt(3 * BLOCK + 5, offset=909)
    expected = greedy(complete(engines["agg"], prompt, 6))
    first = complete(engines["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True})
    real = first.json()["kv_transfer_params"]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(16)
        trap.setblocking(False)
        forged = {**real, "remote_endpoints": [f"127.0.0.1:{trap.getsockname()[1]}"]}
        unsigned = {key: value for key, value in real.items() if key != "remote_signature"}
        recomputed = complete(engines["decode"], prompt, 6, kv_transfer_params=forged)
        refused = complete(engines["decode-mismatch"], prompt, 6, kv_transfer_params=unsigned)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody dialed the endpoint the forged params named
    assert_same(expected, recomputed)
    assert refused.status_code == 502, refused.text
    assert "not signed by a prefill of this cluster" in refused.json()["error"]["message"]
    # The real lease is untouched by either: its own decode still pulls it.
    response = complete(engines["decode"], prompt, 6, kv_transfer_params=real)
    assert_same(expected, response)
    wait_for(lambda: info(engines["prefill"])["stats"]["kv_cache_usage"] == 0.0, 30, "P blocks freed")


def test_engines_run_their_model_in_the_engine_core_unless_told_otherwise(engines):
    """Single-process CPU engines (engine/single_process.py): the model runs in the engine-core
    process, its engine thread bound to the configured core; with single_process off, vLLM's own
    layout (engine core + worker process). Both compute the same: every decode's output here is
    compared with `agg`'s, and decode-shm is the worker-process one."""
    single, split = info(engines["agg"]), info(engines["decode-shm"])
    assert single["single_process"] is True and single["single_process_reason"] == ""
    assert split["single_process"] is False
    processes = vllm_processes(engines["agg"].process.pid)
    assert processes == {"VLLM::EngineCore": [0]}, processes
    processes = vllm_processes(engines["decode-shm"].process.pid)
    assert "VLLM::EngineCore" in processes and any(t.startswith("VLLM::Worker") for t in processes), processes


def test_a_replica_bound_engine_runs_every_thread_on_its_core(engines):
    """cpu_bind_scope replica (engine/cpu_bind.py): every thread of the decode engine's process
    (vLLM's front end, the HTTP app, the KV error inbox) and of the engine core it started runs
    on core 1 alone, after serving the module's requests; `agg` (scope engine) binds its engine
    core, while its front end may run on any core."""
    assert thread_cores(engines["decode"].process.pid) == {(1,)}
    assert info(engines["decode"])["replica_cores"] == [1]
    assert info(engines["agg"])["replica_cores"] is None
    if len(os.sched_getaffinity(0)) > 1:
        assert len(thread_cores(engines["agg"].process.pid)) > 1


# The faster backends: the same identity checks on a few lengths (grpc covers the full matrix).
FAST = {"decode": "grpc", "decode-shm": "shm", "decode-collective": "collective", "decode-mooncake": "mooncake"}


@pytest.mark.parametrize("decode", ["decode-shm", "decode-collective", "decode-mooncake"])
@pytest.mark.parametrize("length", [1, BLOCK + 1, 5 * BLOCK + 64])
def test_fast_backend_greedy_output_matches_aggregated(engines, decode, length):
    prompt = token_prompt(length, offset=length * 13 + 5)
    expected = greedy(complete(engines["agg"], prompt, 8))
    response, _ = handoff(engines["prefill"], engines[decode], prompt, 8)
    assert_same(expected, response)


@pytest.mark.parametrize("decode", ["decode-shm", "decode-collective", "decode-mooncake"])
def test_fast_backend_concurrent_batch_matches_aggregated(engines, decode):
    prompts = [token_prompt(90 + 71 * i, offset=2000 + 97 * i) for i in range(8)]
    expected = [greedy(complete(engines["agg"], p, 10)) for p in prompts]
    before = info(engines[decode])["stats"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: handoff(engines["prefill"], engines[decode], p, 10)[0], prompts))
    for i, (want, got) in enumerate(zip(expected, results)):
        assert_same(want, got, f"prompt {i}")
    after = wait_for(
        lambda: (s := info(engines[decode])["stats"])["kv_pulls_ok"] >= before["kv_pulls_ok"] + 8 and s,
        30,
        "decode pull counters",
    )
    assert after["kv_pulls_failed"] == before["kv_pulls_failed"]


def test_shm_decode_reads_live_leases_without_asking_the_prefill(engines):
    """Once a pull taught it the prefill's addresses, the shm decode reads each live lease's
    blocks itself (one-sided: kv_pulls_one_sided counts them), token for token what the
    aggregated engine says."""
    decode = engines["decode-shm"]
    pulled = info(decode)["stats"]["kv_pulls_ok"]
    handoff(engines["prefill"], decode, token_prompt(BLOCK + 7, offset=71), 2)
    before = wait_for(lambda: (s := info(decode)["stats"])["kv_pulls_ok"] > pulled and s, 30, "a first pull")
    for i in range(3):
        prompt = token_prompt(60 + 90 * i, offset=5000 + 31 * i)
        assert_same(greedy(complete(engines["agg"], prompt, 6)), handoff(engines["prefill"], decode, prompt, 6)[0])
    after = wait_for(
        lambda: (s := info(decode)["stats"])["kv_pulls_ok"] >= before["kv_pulls_ok"] + 3 and s, 30, "decode pulls"
    )
    assert after["kv_pulls_one_sided"] - before["kv_pulls_one_sided"] == 3


@pytest.mark.parametrize("decode", list(FAST))
def test_each_decode_reports_the_backend_it_uses_with_the_prefill(engines, decode):
    handoff(engines["prefill"], engines[decode], token_prompt(BLOCK + 3, offset=9), 2)
    backends = wait_for(lambda: info(engines[decode])["stats"].get("kv_backends"), 30, "backend in decode stats")
    assert backends == {"prefill": FAST[decode]}


def test_router_streams_the_prefill_token_and_retries_an_unreachable_decode(engines):
    """The router (in process) in front of these engines: every stream gets its first token from
    the prefill and decode continues after it, token for token what the aggregated engine says;
    a decode replica that cannot be reached is replaced by the live one without prefilling again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # refused once released
    prompts = [token_prompt(40 + 53 * i, offset=3000 + 97 * i) for i in range(4)]
    expected = [complete(engines["agg"], p, 10).json()["choices"][0]["text"] for p in prompts]
    replicas = [
        ("prefill-0", "prefill", engines["prefill"].url),
        ("decode-dead", "decode", dead),
        ("decode-0", "decode", engines["decode"].url),
    ]

    async def requests(client):
        texts = []
        for prompt in prompts:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                assert response.headers["x-pdcluster-prefill"] == "prefill-0"
                events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: {")]
            texts.append("".join(c["text"] for e in events for c in json.loads(e)["choices"]))
        return texts

    texts, metrics, inflight = through_router(engines, replicas, requests)
    assert texts == expected
    assert 'pdcluster_first_token_source_total{role="prefill"} 4.0' in metrics
    assert (
        'pdcluster_retries_total{role="decode"}' in metrics and 'pdcluster_retries_total{role="prefill"}' not in metrics
    )
    assert all(count == 0 for count in inflight.values())


def test_decode_sent_ahead_streams_what_the_aggregated_engine_says(engines):
    """router.decode_ahead: the continuation leaves with the prefill request and the decode engine
    finds the lease and the first token by key. Every stream after the first (whose lease becomes
    the voucher of the prefill's endpoints) goes that way, and each is token for token, usage
    included, what the aggregated engine answers."""
    prompts = [token_prompt(60 + 71 * i, offset=5000 + 89 * i) for i in range(5)]
    expected = [complete(engines["agg"], p, 10).json() for p in prompts]
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]

    async def requests(client):
        answers = []
        for prompt in prompts:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            body.update(stream=True, stream_options={"include_usage": True})
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            answers.append((text, [e["usage"] for e in events if e.get("usage")]))
        return answers

    answers, metrics, inflight = through_router(engines, replicas, requests, decode_ahead=True)
    for (text, usage), reference in zip(answers, expected):
        assert text == reference["choices"][0]["text"]
        assert [{k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} for u in usage] == [
            {k: reference["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        ]
    assert f'pdcluster_decode_ahead_total{{outcome="streamed"}} {len(prompts) - 1}.0' in metrics
    assert 'outcome="dropped"' not in metrics
    assert all(count == 0 for count in inflight.values())


def test_a_request_admitted_ahead_whose_lease_never_comes_ends_with_the_reason_and_frees_its_blocks(engines):
    """A decode request admitted ahead of a prefill that never files its lease (here: a key no
    prefill was given) is never computed without the prefill's first token: at its deadline the
    engine aborts it and its stream says why; one whose client leaves while it waits is dropped.
    Either way its blocks come back and the engine serves on."""
    decode = engines["decode"]
    voucher = handoff(engines["prefill"], decode, token_prompt(60, offset=777), 2)[1]
    wait_for(lambda: info(decode)["stats"]["kv_cache_usage"] == 0.0, 30, "idle D")
    before = info(decode)["stats"]["kv_pull_failures"].get("abandoned", 0)

    def ahead(deadline_s):
        spec = kvp.AwaitParams(secrets.token_hex(16), KVParams.from_dict(voucher), time.time() + deadline_s)
        body = {"model": NAME, "prompt": token_prompt(300, offset=4321), "max_tokens": 5, "stream": True}
        return {**body, "kv_transfer_params": spec.to_dict()}

    with decode.client() as client:
        answer = client.post("/v1/completions", json=ahead(2))
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert len(events) == 1 and events[0]["error"]["type"] == "kv_transfer_error", answer.text
    assert "admitted ahead of its prefill" in events[0]["error"]["message"]

    async def leave_while_it_waits():
        async with httpx.AsyncClient(base_url=decode.url, headers=decode.headers, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=ahead(120)) as response:
                assert response.status_code == 200
                # it holds its blocks while it waits for the lease
                await asyncio.to_thread(wait_for, lambda: info(decode)["stats"]["kv_cache_usage"] > 0, 30, "held")

    asyncio.run(leave_while_it_waits())
    stats = wait_for(lambda: (s := info(decode)["stats"])["kv_cache_usage"] == 0.0 and s, 30, "blocks back")
    assert stats["kv_pull_failures"].get("abandoned", 0) == before + 2
    assert greedy(complete(decode, token_prompt(20), 3))


@pytest.mark.parametrize("name, waits", [("decode", True), ("decode-shm", False)])
def test_an_engine_whose_requests_only_await_their_lease_waits_instead_of_stepping(engines, name, waits):
    """While its only request waits for a lease (admitted ahead; its prefill never comes here),
    an engine whose connector worker shares its process waits on its input queue, woken by the
    connector (kv_transfer/colocated.py): at most one step per IDLE_WAIT_CAP_S, not vLLM's one per
    millisecond, which vLLM's worker-process layout (`decode-shm`) still takes. Each step sends
    the front end its stats (`steps_recorded`). The request still ends at its deadline."""
    decode = engines[name]
    voucher = handoff(engines["prefill"], decode, token_prompt(60, offset=555), 2)[1]
    wait_for(lambda: info(decode)["stats"]["kv_cache_usage"] == 0.0, 30, "idle D")
    window_s = 1.0
    spec = kvp.AwaitParams(secrets.token_hex(16), KVParams.from_dict(voucher), time.time() + 30)
    body = {"model": NAME, "prompt": token_prompt(300, offset=999), "max_tokens": 5, "stream": True}

    async def steps_per_second_while_it_waits() -> float:
        async with httpx.AsyncClient(base_url=decode.url, headers=decode.headers, timeout=30) as client:
            request = {**body, "kv_transfer_params": spec.to_dict()}
            async with client.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                await asyncio.to_thread(wait_for, lambda: info(decode)["stats"]["kv_cache_usage"] > 0, 30, "held")
                before, start = info(decode)["stats"]["steps_recorded"], time.monotonic()
                await asyncio.sleep(window_s)
                return (info(decode)["stats"]["steps_recorded"] - before) / (time.monotonic() - start)

    rate = asyncio.run(steps_per_second_while_it_waits())
    if waits:
        assert rate <= 2 / IDLE_WAIT_CAP_S, f"{name} stepped {rate:.0f} times a second while its request waited"
    else:
        assert rate > 4 / IDLE_WAIT_CAP_S, f"{name} (vLLM's layout) stepped only {rate:.0f} times a second"
    wait_for(lambda: info(decode)["stats"]["kv_cache_usage"] == 0.0, 30, "blocks back")
    assert greedy(complete(decode, token_prompt(20), 3))


def test_fail_policy_through_the_router_gives_clear_errors_and_abandoned_leases_expire(engines):
    """The router in front of the prefill and a decode whose every pull fails (a layout mismatch,
    failure policy `fail`), half of the requests abandoned between prefill and decode (injected:
    a client gone): a failed pull is a 502 naming the KV handoff and the policy (an SSE error
    event when streaming), an abandoned one a 503, and the prefill's blocks all come back, the
    abandoned ones' once their leases expire."""
    prefill = engines["prefill"]
    baseline = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, 30, "idle P")
    replicas = [("prefill-0", "prefill", prefill.url), ("decode-0", "decode", engines["decode-mismatch"].url)]
    prompts = [token_prompt(150 + 40 * i, offset=311 * i) for i in range(10)]

    async def requests(client):
        answers = [
            await client.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 8}) for p in prompts
        ]
        body = {"model": NAME, "prompt": token_prompt(170, offset=9999), "max_tokens": 8, "stream": True}
        streamed = await client.post("/v1/completions", json=body)
        return answers, streamed

    (answers, streamed), _, _ = through_router(engines, replicas, requests, abandon_after_prefill_rate=0.5)
    abandoned = [r for r in answers if r.status_code == 503]
    failed = [r for r in answers if r.status_code != 503]
    assert abandoned and failed
    for r in abandoned:
        assert r.json()["error"]["type"] == "fault_injection"
    for r in failed:
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["type"] == "kv_transfer_error" and "failure_policy=fail" in error["message"], error
    assert "kv_transfer_error" in streamed.text or "fault_injection" in streamed.text
    # Failed pulls released their leases; abandoned ones were never pulled and expire.
    after = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, LEASE_S + 30, "expiry")
    assert after["kv_leases_expired"] - baseline["kv_leases_expired"] >= len(abandoned)


def test_vllms_sockets_live_in_each_engines_own_directory(engines):
    """vLLM's ZMQ sockets between an engine's processes are in a directory of that engine's own,
    not loose in the temp directory where a process that dies leaves them (test_lifetime: the
    directory goes when the engine stops)."""
    tmp = Path(tempfile.gettempdir())
    for name in ("prefill", "decode-shm"):  # single-process, and vLLM's own worker layout
        host = psutil.Process(engines[name].process.pid)
        children = host.children(recursive=True)
        # The host set it for the processes vLLM spawns (its own /proc environ predates that, as
        # does that of a helper started before the engine, such as multiprocessing's tracker).
        bases = {base for p in children if (base := p.environ().get("VLLM_RPC_BASE_PATH"))}
        assert len(bases) == 1, (name, bases)
        base = Path(bases.pop())
        assert base.parent == tmp and base.name.startswith("pdcluster-vllm-ipc-"), base
        bound = {c.laddr for p in (host, *children) for c in p.net_connections(kind="unix") if c.laddr}
        ipc = {Path(path) for path in bound if Path(path).parent in (tmp, base)}
        assert ipc and all(path.parent == base for path in ipc), (name, ipc)
