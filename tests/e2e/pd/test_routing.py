"""Cache-aware routing on a real cluster (tests/e2e/conftest.py's `pd_cluster`: 2 prefill + 2 decode,
`router.policy: cache_aware`): the engines' KV events reach the router, a repeated prefix goes to
the prefill replica that holds it, and a shared system prompt hits there. A crashed replica's
index dropped and its replacement followed: test_reliability's prefill kill; the local-prefill
path: test_planner."""

from __future__ import annotations

import pytest

from tests.support.cluster import complete
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
