"""Cache-aware routing on a real cluster (tests/e2e/conftest.py's `pd_cluster`: 2 prefill + 2 decode,
`router.policy: cache_aware`, `local_prefill_max_tokens` 256): the engines' KV events reach the
router, a repeated prefix goes to the prefill replica that holds it, a shared system prompt hits
there, and the local-prefill path (decode holds all but a few tokens of the prompt) answers as the
P/D path does (float32, token for token with logprobs). A crashed replica's index dropped and its
replacement followed: test_reliability's prefill kill."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import PD_LOCAL_PREFILL_MAX
from tests.support.cluster import TEST_DTYPE
from tests.support.identity import assert_same_greedy, greedy_completion
from tests.support.prompts import heldout_prompts, token_prompt

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size
WAIT_S = 240


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    pd_cluster.wait_status(following, WAIT_S, "the router to follow every replica's KV events")
    return pd_cluster


def following(status) -> bool:
    cache = status.get("cache") or {}
    ready = {r["replica"] for r in status["replicas"] if r["state"] == "ready"}
    known = cache.get("replicas") or {}
    return bool(cache.get("hashing")) and ready <= {rid for rid, c in known.items() if c["source"] == "events"}


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as client:
        yield client


def complete(http, prompt, **body):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    return response


def routes(cluster) -> dict:
    return cluster.status()["routes"]


def test_a_repeated_prefix_goes_to_the_prefill_replica_that_holds_it(cluster, http):
    shared = [token_prompt(4 * BLOCK, offset=9000 + 3000 * i) for i in range(2)]
    first = [complete(http, p).headers["x-pdcluster-prefill"] for p in shared]
    assert first[0] != first[1]  # equal cost, neither holds it: they share the work
    for round_ in range(2):
        for i, (prefix, holder) in enumerate(zip(shared, first)):
            # more new tokens than local_prefill_max_tokens: decode holds the prefix too, but P/D it is
            suffix = token_prompt(200, offset=20_000 + 1000 * round_ + 300 * i)
            assert complete(http, prefix + suffix).headers["x-pdcluster-prefill"] == holder


def test_a_shared_system_prompt_across_chats_hits_on_one_prefill(cluster, http):
    system = {"role": "system", "content": "\n".join(heldout_prompts()[20:30])}
    served = []
    for i in range(3):  # user turns longer than local_prefill_max_tokens: each takes the P/D path
        question = "\n".join(heldout_prompts()[30 + 5 * i : 35 + 5 * i])
        body = {"model": "tiny", "messages": [system, {"role": "user", "content": question}], "max_tokens": 4}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        served.append(response.headers["x-pdcluster-prefill"])
    assert len(set(served)) == 1
    cluster.wait_status(
        lambda s: (
            next(r for r in s["replicas"] if r["replica"] == served[0])["stats"]["prefix_cache_hits"] >= 2 * 2 * BLOCK
        ),  # the 2nd and 3rd chats found the system prompt's blocks (vLLM's own count)
        WAIT_S,
        f"prefix-cache hits on {served[0]}",
    )


def test_the_local_prefill_path_answers_as_the_pd_path(cluster, http):
    """The first request takes P/D; its decode replica now holds the prompt's full blocks, so the
    same prompt again leaves it fewer than local_prefill_max_tokens to compute: decode alone."""
    prompt = token_prompt(3 * BLOCK + 10, offset=33_000)  # again: 138 to compute (MTP recomputes a block)
    assert len(prompt) > PD_LOCAL_PREFILL_MAX >= len(prompt) - 2 * BLOCK
    before = routes(cluster)
    pd = greedy_completion(http, prompt, 16)
    local = greedy_completion(http, prompt, 16)
    after = routes(cluster)
    assert after.get("pd", 0) - before.get("pd", 0) == 1
    assert after.get("local_prefill", 0) - before.get("local_prefill", 0) == 1
    assert_same_greedy(pd, local, TEST_DTYPE, "local-prefill path vs P/D path")
    whole = complete(http, prompt, max_tokens=16).json()["choices"][0]["text"]
    streamed = complete(http, prompt, stream=True, max_tokens=16)
    assert "x-pdcluster-prefill" not in streamed.headers  # decode alone, streaming too
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert routes(cluster).get("local_prefill", 0) - before.get("local_prefill", 0) == 3
