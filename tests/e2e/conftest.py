"""Fixtures several e2e modules share, each started once.

`reference_engine` (session): one aggregated engine of the model as every cluster under test runs
it (float32, MTP k=1), whose greedy outputs are the identity reference of test_cluster,
test_kv_faults and test_multinode; it also publishes its KV cache events into a 48-block cache,
which test_kv_events follows (its identity outputs do not depend on what its cache holds).

`pd_cluster` (package): 2 prefill + 2 decode replicas with cache-aware routing, killed, fuzzed
and probed by test_reliability, and routed by test_routing.
"""

from __future__ import annotations

import pytest

from tests.support.cluster import cluster_up, write_config
from tests.support.engines import run_engine, tiny_engine

REFERENCE_BLOCKS = 48  # 48 blocks of 128 tokens: test_kv_events' prompts evict
PD_SECRET = "reliability-secret-7f3a9c"
PD_LEASE_S = 8
# router.local_prefill_max_tokens: MTP engines recompute a hit's last 128-token block, so decode
# computes at least 129 tokens of any prompt it holds; prompts this short take the local path too.
PD_LOCAL_PREFILL_MAX = 256


@pytest.fixture(scope="session")
def reference_engine(tmp_path_factory):
    spec = tiny_engine(
        "reference",
        dtype="float32",
        speculative={"method": "mtp", "num_speculative_tokens": 1},
        kv_events=True,
        engine_args={"num_gpu_blocks_override": REFERENCE_BLOCKS},
    )
    with run_engine(spec, tmp_path_factory.mktemp("reference")) as engine:
        yield engine


@pytest.fixture(scope="package")
def pd_cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("pd-cluster")
    (home / "secret").write_text(PD_SECRET)
    config = write_config(
        home / "cluster.yaml",
        name="e2e-rel",
        roles={"prefill": {"replicas": 2}, "decode": {"replicas": 2}},
        model={"max_model_len": 4096},  # room for streams long enough to be killed mid-way
        kv_transfer={"secret_file": str(home / "secret"), "lease_seconds": PD_LEASE_S},
        router={
            "max_body_bytes": 1 << 20,
            "policy": "cache_aware",
            "local_prefill_max_tokens": PD_LOCAL_PREFILL_MAX,
        },
    )
    with cluster_up(home, config) as running:
        yield running
