"""`pd_cluster` (package): 2 prefill + 2 decode replicas with cache-aware routing, killed, fuzzed
and probed by test_reliability, routed by test_routing and probed by test_security: one cluster
start for the three. A package of its own so that the cluster stops when its last module ends
(a package fixture of tests/e2e lived to the clusters lane's end: ~9 GB of engines and actors
beside the modules after it, and Ray's memory monitor killed the multi-host test's controller)."""

from __future__ import annotations

import os

import pytest

from pdcluster.engine.vllm_segments import mapped_segments
from tests.support.cluster import cluster_processes, cluster_up, write_config

PD_SECRET = "reliability-secret-7f3a9c"
PD_LEASE_S = 8


@pytest.fixture(scope="package")
def pd_cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("pd-cluster")
    (home / "secret").write_text(PD_SECRET)
    config = write_config(
        home / "cluster.yaml",
        name="e2e-rel",
        # prefill keeps vLLM's worker process (its engine core and worker talk through /dev/shm
        # queues, as every engine with tensor parallelism does): the cluster tests that path too
        roles={"prefill": {"replicas": 2, "single_process": False}, "decode": {"replicas": 2}},
        model={"max_model_len": 4096},  # room for streams long enough to be killed mid-way
        kv_transfer={"secret_file": str(home / "secret"), "lease_seconds": PD_LEASE_S},
        router={
            "max_body_bytes": 1 << 20,
            "policy": "cache_aware",
        },
    )
    with cluster_up(home, config) as running:
        yield running
        queues = {path for pid in cluster_processes(home, ("VLLM::",)) for path in mapped_segments(pid)}
    # `down` left none of vLLM's queues between an engine core and its worker in /dev/shm (before,
    # it could leave an engine's two, 400 MB: vLLM's shutdown ends its processes before they unlink
    # them, and Ray kills the host's resource tracker with the host: engine/vllm_segments.py)
    assert queues, "no engine process maps a queue to a worker: does prefill keep its worker process?"
    assert [path for path in queues if os.path.exists(path)] == []
