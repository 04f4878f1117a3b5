"""The SLO planner acting on a real cluster (`autoscale:`, mode act): a flood of long prompts
makes TTFT miss its target while prompts queue on the one prefill replica, and the planner adds a
second one within a bounded number of intervals; once the flood is over and the targets are met
with margin it scales prefill back to one. No request fails throughout.

The same cluster (1 prefill + 1 decode, cache-aware, `local_prefill_max_tokens` 256) checks
conditional disaggregation: the local-prefill path answers as the P/D path does (float32, tokens
and logprobs)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.support.cluster import TEST_DTYPE, cluster_up, complete, write_config
from tests.support.cores import FIRST, SECOND
from tests.support.identity import assert_same_greedy, greedy_completion
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e

INTERVAL_S = 1.0
HYSTERESIS = 2
LOCAL_PREFILL_MAX = 256  # MTP engines recompute a hit's last 128-token block: at least 129 tokens
BLOCK = 128
START_S = 240  # a prefill replica's start on this shared 2-core machine, with the flood running


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("planner")
    config = write_config(
        home / "cluster.yaml",
        name="e2e-planner",
        model={"max_model_len": 4096},
        roles={"prefill": {"cpu_bind": [FIRST, SECOND]}},  # its core pool: room for a second replica
        router={"policy": "cache_aware", "local_prefill_max_tokens": LOCAL_PREFILL_MAX},
        autoscale={
            "enabled": True,
            "ttft_p90_ms": 600,
            "itl_p90_ms": 5000,  # decode is not what this test is about
            "prefill": {"min": 1, "max": 2},
            "decode": {"min": 1, "max": 1},
            "interval_seconds": INTERVAL_S,
            "window_seconds": 4,
            "cooldown_seconds": 3,
            "hysteresis": HYSTERESIS,
        },
    )
    with cluster_up(home, config) as running:
        yield running


def prefills(status) -> list[str]:
    return sorted(r["replica"] for r in status["replicas"] if r["role"] == "prefill" and r["state"] == "ready")


def test_a_flood_of_long_prompts_adds_prefill_and_the_calm_after_removes_it(cluster):
    assert prefills(cluster.status()) == ["prefill-0"]
    stop, decided, failures, served = threading.Event(), threading.Event(), [], [0]

    def client(i: int) -> None:
        with httpx.Client(base_url=cluster.endpoint, timeout=300) as http:
            n = 0
            # Once the planner asked for a second prefill, one client keeps the flood going (the
            # planner holds while a replica starts): the other five only took CPU from that start.
            while not stop.is_set() and not (i and decided.is_set()):
                body = {"model": "tiny", "prompt": token_prompt(3000, offset=7919 * (8 * n + i)), "max_tokens": 2}
                try:
                    response = http.post("/v1/completions", json={**body, "stream": True})
                    if response.status_code != 200 or 'data: {"error"' in response.text:
                        failures.append(response.text[:300])
                    served[0] += 1
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                n += 1

    flood = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for thread in flood:
        thread.start()
    try:
        added = cluster.wait_status(
            lambda s: (s.get("planner") or {}).get("rule") == "add_prefill", 120, "the planner to add prefill"
        )
        decided.set()
        assert "TTFT p90" in added["planner"]["reason"] and added["planner"]["desired"]["prefill"] == 2
        cluster.wait_status(lambda s: len(prefills(s)) == 2, START_S, "the second prefill replica to serve")
        during = served[0]
    finally:
        stop.set()
        for thread in flood:
            thread.join(300)
    assert served[0] > during  # the flood went on while it started
    calm = cluster.wait_status(
        lambda s: (s.get("planner") or {}).get("rule") == "remove" and len(prefills(s)) == 1,
        120,
        "the planner to scale prefill back to one",
    )
    assert calm["planner"]["actions"] == [["prefill", "remove"]]
    assert failures == []
    metrics = httpx.get(cluster.endpoint + "/metrics", timeout=30).text
    assert 'pdcluster_planner_decisions_total{action="add",reason="add_prefill",role="prefill"} 1.0' in metrics
    assert 'pdcluster_planner_replicas{kind="actual",role="prefill"}' in metrics
    status_line = cluster.cli("status", "--name", cluster.name).stdout
    assert "planner (act): remove" in status_line


def test_the_local_prefill_path_answers_as_the_pd_path(cluster, http):
    """The first request takes P/D; its decode replica now holds the prompt's full blocks, so the
    same prompt again leaves it fewer than local_prefill_max_tokens to compute: decode alone."""
    # Reversed: the flood's prompts are windows of the same short token stream, and once enough of
    # them were served one began where this window begins (decode then held it before the first
    # request); no window begins with this sequence. Again: 138 to compute (MTP recomputes a block).
    prompt = token_prompt(3 * BLOCK + 10, offset=33_000)[::-1]
    assert len(prompt) > LOCAL_PREFILL_MAX >= len(prompt) - 2 * BLOCK
    before = cluster.routes()
    pd = greedy_completion(http, prompt, 16)
    local = greedy_completion(http, prompt, 16)
    after = cluster.routes()
    assert after.get("pd", 0) - before.get("pd", 0) == 1
    assert after.get("local_prefill", 0) - before.get("local_prefill", 0) == 1
    assert_same_greedy(pd, local, TEST_DTYPE, "local-prefill path vs P/D path")
    whole = complete(http, prompt, max_tokens=16).json()["choices"][0]["text"]
    streamed = complete(http, prompt, stream=True, max_tokens=16)
    assert "x-pdcluster-prefill" not in streamed.headers  # decode alone, streaming too
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert cluster.routes().get("local_prefill", 0) - before.get("local_prefill", 0) == 3
