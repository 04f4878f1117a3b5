"""`reference_engine` (package): one aggregated float32 engine without speculation, started once
for every identity test (test_cluster, test_kv_faults, handoff/, test_mtp_pd,
test_multinode): P/D, MTP and cluster outputs must all equal what it computes alone.

`http` (module): an httpx client on the module's `cluster` endpoint.

`pd_cluster` (package): 2 prefill + 2 decode replicas with cache-aware routing, killed, fuzzed
and probed by test_reliability, and routed by test_routing (one cluster start for both)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import TEST_DTYPE, cluster_up, write_config
from tests.support.cores import FIRST
from tests.support.engines import run_engine, tiny_engine

PD_SECRET = "reliability-secret-7f3a9c"
PD_LEASE_S = 8


@pytest.fixture(scope="package")
def reference_engine(tmp_path_factory):
    spec = tiny_engine("reference", dtype=TEST_DTYPE, engine_args={"max_num_seqs": 16}, cpu_threads_bind=FIRST)
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
        },
    )
    with cluster_up(home, config) as running:
        yield running


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as client:
        yield client
