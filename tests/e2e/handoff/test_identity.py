"""P -> D greedy output identical to the aggregated engine's, token for token and logprob for
logprob (float32): every length class on grpc, decode's prefix-cache hits, a concurrent batch,
text prompts, seeded sampling; KV pulled into the wrong blocks fails the check; the same
checks on the faster backends, each decode reporting the backend it uses."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer.params import KVParams
from tests.e2e.handoff.common import BLOCK, DTYPE, assert_same
from tests.support.cma import skip_unless_cross_process_copies
from tests.support.engines import MAX_MODEL_LEN
from tests.support.handoff import complete, greedy, handoff, info, wait_for
from tests.support.identity import assert_same_greedy, compare
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e


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
    try:
        after = wait_for(
            lambda: (s := info(engines["decode"])["stats"])["kv_pulls_ok"] >= before["kv_pulls_ok"] + 12 and s,
            30,
            "decode pull counters",
        )
    except AssertionError as exc:  # what the engines said about the batch's pulls and leases
        said = [
            f"{name}: {line}"
            for name in ("prefill", "decode")
            for line in engines[name].log_tail(400).splitlines()
            if line.startswith(("WARNING", "ERROR")) and "[pdcluster.kv_transfer" in line
        ]
        raise AssertionError("\n".join([str(exc), json.dumps(info(engines["decode"])["stats"]), *said[-40:]])) from None
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
    skip_unless_cross_process_copies()
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
