"""P/D in bfloat16 (the model's dtype, the shipped configs' `native` on CPUs that compute it) against one
aggregated engine, MTP on.

Strict identity runs in float32 (handoff/, test_mtp_pd.py, test_cluster.py). In bf16 the
same P/D computation, done in another order, may flip a near-tie, and which ones flip depends on
the CPU's kernels (tests/support/identity.py). Here a divergence passes only as a diagnosed
near-tie: the reference's top-1 minus top-2 logprob there and the logprob drift before it both
within the bf16 bounds, both printed (`pytest -s` shows them).

The aggregated engine is also the shipped model as served in its own dtype: it generates
code-like text and its MTP head is accepted at a non-trivial rate (measured 0.74 by
tools/model_card.py; the bar here is well below).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.cores import FIRST, SECOND
from tests.support.engines import run_engines, tiny_engine
from tests.support.identity import Greedy, assert_same_greedy, identity_fields
from tests.support.prompts import heldout_prompts, token_prompt

pytestmark = pytest.mark.e2e

NAME = "tiny"
DTYPE = "bfloat16"
BLOCK = 128
MTP = {"method": "mtp", "num_speculative_tokens": 1}
ACCEPTANCE_FLOOR = 0.5


def spec(engine_id, role, bind, secret_file):
    return tiny_engine(
        engine_id,
        role,
        dtype=DTYPE,
        secret_file=secret_file,
        engine_args={"max_num_seqs": 16},
        speculative=MTP,
        cpu_threads_bind=bind,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    secret = tmp / "secret"
    secret.write_text("bf16-test-secret")
    specs = [
        spec("agg", "aggregated", FIRST, secret),
        spec("prefill", "prefill", FIRST, secret),
        spec("decode", "decode", SECOND, secret),
    ]
    with run_engines(specs, tmp) as running:
        yield running


def greedy(engine, prompt, max_tokens, **extra) -> Greedy:
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **identity_fields(),
        **extra,
    }
    response = httpx.post(engine.url + "/v1/completions", json=body, headers=engine.headers, timeout=120)
    assert response.status_code == 200, response.text
    if "kv_transfer_params" in extra and extra["kv_transfer_params"].get("do_remote_decode"):
        return response.json()["kv_transfer_params"]
    return Greedy.from_choice(response.json()["choices"][0])


def handoff(engines, prompt, max_tokens) -> Greedy:
    params = greedy(engines["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True})
    return greedy(engines["decode"], prompt, max_tokens, kv_transfer_params=params)


@pytest.mark.parametrize(
    "prompt",
    [
        token_prompt(1, offset=11),
        token_prompt(BLOCK + 1, offset=1300),
        token_prompt(3 * BLOCK + 5, offset=2600),
        token_prompt(1015, offset=40),
        "def fibonacci(n):\n    ",
    ],
    ids=["1", "129", "389", "1015", "text"],
)
def test_bf16_handoff_matches_aggregated_up_to_near_ties(engines, prompt):
    max_tokens = 8 if len(prompt) > 1000 else 24
    expected = greedy(engines["agg"], prompt, max_tokens)
    assert_same_greedy(expected, handoff(engines, prompt, max_tokens), DTYPE)


def test_bf16_concurrent_batch_and_prefix_hit_match_up_to_near_ties(engines):
    prompts = [token_prompt(90 + 71 * i, offset=5000 + 97 * i) for i in range(8)]
    expected = [greedy(engines["agg"], p, 16) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: handoff(engines, p, 16), prompts))
    for i, (want, got) in enumerate(zip(expected, results)):
        assert_same_greedy(want, got, DTYPE, f"prompt {i}")
    # The same long prompt again: decode's prefix cache holds its leading blocks, only the rest is
    # pulled (with MTP, vLLM drops the last block of a hit: the drafter needs that block's states).
    start = decode_stats(engines)
    handoff(engines, token_prompt(20, offset=9100), 2)  # a one-block prompt: one block's bytes
    before = decode_stats(engines)
    again = handoff(engines, prompts[-1], 16)
    after = decode_stats(engines)
    assert_same_greedy(expected[-1], again, DTYPE, "prefix-cache hit")
    assert after["kv_pulls_ok"] == before["kv_pulls_ok"] + 1
    one_block = before["kv_bytes_received"] - start["kv_bytes_received"]
    pulled, blocks = after["kv_bytes_received"] - before["kv_bytes_received"], -(-len(prompts[-1]) // BLOCK)
    assert pulled % one_block == 0 and 1 <= pulled // one_block < blocks, (pulled, one_block, blocks)


def decode_stats(engines) -> dict:
    decode = engines["decode"]
    return httpx.get(decode.url + "/pdcluster/info", headers=decode.headers, timeout=30).json()["stats"]


def test_the_shipped_model_generates_code_and_its_mtp_is_accepted(engines):
    engine = engines["agg"]
    with engine.client() as client:
        before = client.get("/pdcluster/info").json()["stats"]
        body = {"model": NAME, "prompt": list(heldout_prompts()), "max_tokens": 64, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        texts = [c["text"] for c in response.json()["choices"]]
        after = client.get("/pdcluster/info").json()["stats"]
        # The README's first example: the model's own defaults (greedy) give the same code-shaped
        # text on every call.
        readme = {"model": NAME, "prompt": "import os\n", "max_tokens": 48, "repetition_penalty": 1.2}
        first, again = (client.post("/v1/completions", json=readme).json()["choices"][0]["text"] for _ in range(2))
    assert first == again and "import" in first and len(set(first.split())) > 5, first
    assert len(texts) == 50 and all(texts)
    # Code-like: most continuations contain Python punctuation and keywords, not one token repeated.
    looks_like_code = sum(
        any(tok in t for tok in ("(", ")", ":", "=", "self", "return", "def ", "    ")) and len(set(t.split())) > 3
        for t in texts
    )
    assert looks_like_code >= 30  # 37 of 50 when measured; greedy loops account for most of the rest
    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafts > 1000
    assert accepted / drafts >= ACCEPTANCE_FLOOR, (accepted, drafts)
