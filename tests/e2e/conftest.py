"""`reference_engine` (package): one aggregated float32 engine without speculation, started once
for every identity test (test_cluster, test_kv_faults, handoff/, test_mtp_pd,
test_multinode): P/D, MTP and cluster outputs must all equal what it computes alone.

`http` (module): an httpx client on the module's `cluster` endpoint.

(`pd_cluster`, the cluster pd/'s modules share: pd/conftest.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import TEST_DTYPE
from tests.support.cores import FIRST
from tests.support.engines import run_engine, tiny_engine


@pytest.fixture(scope="package")
def reference_engine(tmp_path_factory):
    spec = tiny_engine("reference", dtype=TEST_DTYPE, engine_args={"max_num_seqs": 16}, cpu_threads_bind=FIRST)
    with run_engine(spec, tmp_path_factory.mktemp("reference")) as engine:
        yield engine


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as client:
        yield client
