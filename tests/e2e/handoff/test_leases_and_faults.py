"""A lease's life on real engines: renewed while decode queues, released after a pull or a
failed one, expired when decode never comes; a failed pull recomputes or fails naming why; a
request admitted ahead whose lease never comes ends with the reason, its engine waiting rather
than stepping meanwhile. Security: every engine port takes only the cluster's key, and decode
dials only what a prefill of the cluster signed."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.colocated import IDLE_WAIT_CAP_S
from pdcluster.kv_transfer.params import KVParams
from tests.e2e.handoff.common import BLOCK, LEASE_S, assert_same
from tests.support.engines import assert_engine_key_required
from tests.support.handoff import NAME, complete, greedy, handoff, info, wait_for
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e


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

    def cleaned_up(abandoned):
        """Its blocks back and `abandoned` loads reported so (the count comes with the stats of a
        step; the blocks may be seen back a step earlier)."""
        s = info(decode)["stats"]
        return s["kv_cache_usage"] == 0.0 and s["kv_pull_failures"].get("abandoned", 0) >= before + abandoned and s

    def seen():
        s = info(decode)["stats"]
        return {"kv_cache_usage": s["kv_cache_usage"], "abandoned": s["kv_pull_failures"].get("abandoned", 0) - before}

    with decode.client() as client:
        answer = client.post("/v1/completions", json=ahead(2))
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert len(events) == 1 and events[0]["error"]["type"] == "kv_transfer_error", answer.text
    assert "admitted ahead of its prefill" in events[0]["error"]["message"]
    # Its answer may be written before the engine core freed its blocks: until they are back, the
    # next request's wait for blocks held would be met by these.
    wait_for(lambda: cleaned_up(1), 30, "the first request's blocks back, its load reported abandoned", seen)

    async def leave_while_it_waits():
        async with httpx.AsyncClient(base_url=decode.url, headers=decode.headers, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=ahead(120)) as response:
                assert response.status_code == 200
                # admitted: it holds its blocks while it waits for the lease
                await asyncio.to_thread(wait_for, lambda: info(decode)["stats"]["kv_cache_usage"] > 0, 30, "held")

    asyncio.run(leave_while_it_waits())
    stats = wait_for(lambda: cleaned_up(2), 30, "the second request's blocks back, its load reported abandoned", seen)
    assert stats["kv_pull_failures"].get("abandoned", 0) == before + 2
    assert greedy(complete(decode, token_prompt(20), 3))


WINDOWS = 5


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

    async def steps_per_second_while_it_waits() -> list[float]:
        """Steps a second in up to WINDOWS one-second windows (a busy engine's rate shows in the
        first window where it gets a CPU: the suite's other lane may take both cores for a while)."""
        rates = []
        async with httpx.AsyncClient(base_url=decode.url, headers=decode.headers, timeout=30) as client:
            request = {**body, "kv_transfer_params": spec.to_dict()}
            async with client.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                await asyncio.to_thread(wait_for, lambda: info(decode)["stats"]["kv_cache_usage"] > 0, 30, "held")
                while len(rates) < WINDOWS and (waits or not rates or rates[-1] <= 4 / IDLE_WAIT_CAP_S):
                    before, start = info(decode)["stats"]["steps_recorded"], time.monotonic()
                    await asyncio.sleep(window_s)
                    rates.append((info(decode)["stats"]["steps_recorded"] - before) / (time.monotonic() - start))
        return rates

    rates = asyncio.run(steps_per_second_while_it_waits())
    if waits:
        assert max(rates) <= 2 / IDLE_WAIT_CAP_S, (
            f"{name} stepped {max(rates):.0f} times a second while its request waited"
        )
    else:
        assert max(rates) > 4 / IDLE_WAIT_CAP_S, (
            f"{name} (vLLM's layout) stepped at most {max(rates):.0f} times a second"
        )
    wait_for(lambda: info(decode)["stats"]["kv_cache_usage"] == 0.0, 30, "blocks back")
    assert greedy(complete(decode, token_prompt(20), 3))


# -- security: engine ports take only the cluster's requests; decode dials only what P signed --


@pytest.mark.parametrize("name", ["agg", "prefill", "decode"])
def test_every_engine_port_requires_the_engine_key(engines, name):
    engine = engines[name]
    assert_engine_key_required(engine.url, engine.headers)


def test_forged_params_dial_nothing_and_are_recomputed_or_refused(engines):
    """Params a prefill signed, pointed at another endpoint (or stripped of the signature, or with
    one that is not hex), make decode dial nothing: recomputed under `recompute`, a 502 naming why
    under `fail`."""
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
        garbled = {**real, "remote_signature": "é" * 64}  # not hex digits, not even ASCII
        recomputed_too = complete(engines["decode"], prompt, 6, kv_transfer_params=garbled)
        refused = complete(engines["decode-mismatch"], prompt, 6, kv_transfer_params=unsigned)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody dialed the endpoint the forged params named
    assert_same(expected, recomputed)
    assert_same(expected, recomputed_too)
    assert refused.status_code == 502, refused.text
    assert "not signed by a prefill of this cluster" in refused.json()["error"]["message"]
    # The real lease is untouched by either: its own decode still pulls it.
    response = complete(engines["decode"], prompt, 6, kv_transfer_params=real)
    assert_same(expected, response)
    wait_for(lambda: info(engines["prefill"])["stats"]["kv_cache_usage"] == 0.0, 30, "P blocks freed")
