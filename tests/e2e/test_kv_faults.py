"""KV handoff faults on the CPU cluster, injected through the config's fault_injection settings:
a share of pulls is dropped mid-transfer, dials an unreachable producer, or times out against a
stalled producer; every request still completes with the same greedy output as an aggregated
engine, and the prefill's blocks all come back. (The `fail` policy through the router, with
requests abandoned between prefill and decode: tests/e2e/handoff/, on engines without a cluster.)
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import TEST_DTYPE, cluster_up, write_config
from tests.support.identity import Greedy, assert_same_greedy, greedy_completion
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e

NAME = "tiny"
PROMPTS = [token_prompt(150 + 40 * i, offset=311 * i) for i in range(16)]


def stats(status: dict, role: str) -> dict:
    return next(r for r in status["replicas"] if r["role"] == role)["stats"]


@pytest.fixture(scope="module")
def reference(reference_engine):
    with reference_engine.client() as http:
        return [greedy(http, p) for p in PROMPTS]


def greedy(http: httpx.Client, prompt) -> Greedy:
    return greedy_completion(http, prompt, 12, NAME)


def test_recompute_policy_survives_dropped_unreachable_and_timed_out_pulls(tmp_path, reference):
    config = write_config(
        tmp_path / "recompute.yaml",
        name="e2e-recompute",
        kv_transfer={
            "failure_policy": "recompute",
            "lease_seconds": 6,
            "pull_timeout_seconds": 1.5,
            # every pull asks the producer, so that its injected stalls are on the pulls' path
            "one_sided_reads": False,
            "fault_injection": {
                "pull_failure_rate": 0.25,
                "unreachable_rate": 0.25,
                "serve_delay_s": 3.0,
                "serve_delay_rate": 0.25,
                "seed": 7,
            },
        },
    )
    with cluster_up(tmp_path, config) as cluster:
        with httpx.Client(base_url=cluster.endpoint, timeout=120) as http:
            for i, (prompt, expected) in enumerate(zip(PROMPTS, reference)):
                assert_same_greedy(expected, greedy(http, prompt), TEST_DTYPE, f"prompt {i}")
        # Engine stats reach status within a monitor interval.
        status = cluster.wait_status(
            lambda s: (d := stats(s, "decode"))["kv_pulls_ok"] + d["kv_pulls_failed"] >= len(PROMPTS),
            30,
            "pull counters",
        )
        decode = stats(status, "decode")
        assert decode["kv_pulls_failed"] >= 4 and decode["kv_pulls_ok"] >= 2
        # Every lease ends: released by the consumer, or expired when the release was lost.
        cluster.wait_status(lambda s: stats(s, "prefill")["kv_cache_usage"] == 0.0, 60, "prefill blocks freed")
