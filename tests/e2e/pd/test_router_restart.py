"""The router dying on a running cluster (pd/conftest.py's `pd_cluster`: 2 prefill + 2 decode): its
actor process SIGKILLed, as the OOM killer would. The controller starts a new router on the same
endpoint, with the replica table (orchestrator/router_keeper.py); test_routing, the module after
this one, then routes by the new router's cache index."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.cluster import cluster_processes, complete
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


def test_a_killed_router_is_replaced_on_its_endpoint_and_serves_through_both_roles(cluster, http):
    """Nothing started another router: the endpoint answered nothing until `down` and `up`, while
    every replica behind it still ran."""
    (killed,) = cluster_processes(cluster.home, ("ray::RouterActor",))
    os.kill(killed, signal.SIGKILL)
    status = cluster.wait_status(
        lambda s: s.get("router_restarts") == 1 and not s.get("router_error"), 180, "a new router"
    )
    assert status["endpoint"] == cluster.endpoint
    assert list(cluster_processes(cluster.home, ("ray::RouterActor",))) != [killed]
    # Both roles are in the new router's table from its first request: this prompt takes the P/D
    # path (the cluster's local-prefill thresholds are off: tests/support/cluster.py).
    response = complete(http, token_prompt(600, offset=31_000))
    assert response.headers["x-pdcluster-prefill"].startswith("prefill-")
    assert response.headers["x-pdcluster-decode"].startswith("decode-")
    assert cluster.routes().get("pd", 0) >= 1  # the new router's own count
    assert "router: restarted 1 time(s) (its actor died)" in cluster.cli("status").stdout
