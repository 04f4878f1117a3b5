"""The router dying on a running cluster (pd/conftest.py's `pd_cluster`: 2 prefill + 2 decode): its
actor process SIGKILLed, as the OOM killer would, then SIGSTOPped, as a hung one. The controller
starts a new router on the same endpoint, with the replica table (orchestrator/router_keeper.py);
test_routing, the module after this one, then routes by the new router's cache index."""

from __future__ import annotations

import contextlib
import os
import signal

import httpx
import psutil
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
    assert "router: restarted 1 time(s) (it died or hung)" in cluster.cli("status").stdout


def test_a_stopped_router_is_killed_and_replaced(cluster):
    """A router whose process stopped (SIGSTOP, as an event loop stuck for good) is alive to Ray:
    the controller's hand-over of the replica table waited on it for good, and with it the
    controller's monitor (every replica's health check and restart), and `status` waited too.
    Three updates unanswered, and it is killed and another started on the same endpoint."""
    (stopped,) = cluster_processes(cluster.home, ("ray::RouterActor",))
    os.kill(stopped, signal.SIGSTOP)
    try:
        status = cluster.wait_status(
            lambda s: s.get("router_restarts") == 2 and not s.get("router_error"), 240, "a router for the stopped one"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)  # (killed by then, unless the test failed)
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
    assert status["endpoint"] == cluster.endpoint
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as http:
        response = complete(http, token_prompt(600, offset=32_000))
    assert response.headers["x-pdcluster-prefill"].startswith("prefill-")
