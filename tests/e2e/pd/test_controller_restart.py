"""The controller dying on a running cluster (pd/conftest.py's `pd_cluster`: 2 prefill + 2 decode):
its process SIGKILLed, as the OOM killer or a crash would. Ray restarts it and it takes the
cluster back from its record (orchestrator/recovery.py); the router and the replicas, detached,
serve on meanwhile. The modules after this one run on the cluster it took back."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.cluster import cluster_processes, complete
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e

SERVING = ("ray::RouterActor", "ray::PrefillWorker", "ray::DecodeWorker")


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


def test_a_killed_controller_is_restarted_and_the_cluster_serves_throughout(cluster, http):
    """The router and every replica were the controller's actors and went with it: the endpoint
    answered nothing, every request in flight was lost, until `down` and `up`."""
    ready = sorted(r["replica"] for r in cluster.status()["replicas"] if r["state"] == "ready")
    serving = set(cluster_processes(cluster.home, SERVING))  # their pids
    (controller,) = cluster_processes(cluster.home, ("ray::Controller",))
    os.kill(controller, signal.SIGKILL)
    # At once, while Ray restarts the controller: both roles serve a P/D request.
    response = complete(http, token_prompt(600, offset=34_000))
    assert response.headers["x-pdcluster-prefill"].startswith("prefill-")
    assert response.headers["x-pdcluster-decode"].startswith("decode-")
    # The new controller took the same replicas back (none started again) and runs them: its
    # monitor's health checks answered (each row's pid comes from one).
    status = cluster.wait_status(
        lambda s: s.get("controller_restarts") == 1 and all(r["pid"] for r in s["replicas"]),
        120,
        "a restarted controller running its replicas",
    )
    assert sorted(r["replica"] for r in status["replicas"] if r["state"] == "ready") == ready
    assert all(r["transitions"][0][1] == "starting" for r in status["replicas"])  # their history kept
    assert status["endpoint"] == cluster.endpoint and not status["router_error"]
    assert set(cluster_processes(cluster.home, SERVING)) == serving  # the same processes: none restarted
    assert list(cluster_processes(cluster.home, ("ray::Controller",))) != [controller]
    response = complete(http, token_prompt(600, offset=35_000))
    assert response.headers["x-pdcluster-prefill"].startswith("prefill-")
    assert (
        "controller: restarted 1 time(s) (it died; the router and the replicas served on)"
        in cluster.cli("status").stdout
    )


def test_a_restarted_controller_keeps_the_sizes_scale_set(cluster):
    """The record holds `scale`'s sizes and the replica numbering: a controller restarted from the
    cluster YAML alone would start again the replica an operator removed."""
    cluster.cli("scale", "decode", "1", "--name", cluster.name)
    cluster.wait_status(lambda s: [r["state"] for r in decodes(s)] == ["ready"], 120, "one decode replica left")
    (controller,) = cluster_processes(cluster.home, ("ray::Controller",))
    os.kill(controller, signal.SIGKILL)
    status = cluster.wait_status(
        lambda s: s.get("controller_restarts") == 2 and all(r["pid"] for r in s["replicas"]),
        120,
        "the controller restarted a second time",
    )
    assert [r["state"] for r in decodes(status)] == ["ready"]  # none started in the removed one's place
    (left,) = (r["replica"] for r in decodes(status))
    cluster.cli("scale", "decode", "2", "--name", cluster.name)  # as the modules after this one need
    status = cluster.wait_status(
        lambda s: [r["state"] for r in decodes(s)] == ["ready", "ready"], 300, "two decode replicas again"
    )
    numbers = sorted(int(r["replica"].split("-")[1]) for r in decodes(status))
    assert numbers == [int(left.split("-")[1]), 2]  # a new id, after every one the cluster had


def test_status_gives_up_on_a_stopped_controller_in_one_line(cluster):
    """A controller whose process stopped (SIGSTOP, as an event loop stuck) is alive to Ray, which
    restarts nothing: `status` waited ~40 s on Ray's connection attempts, then printed Ray's own
    ActorUnavailableError; now it gives up after its --timeout, in one line saying what it means."""
    (controller,) = cluster_processes(cluster.home, ("ray::Controller",))
    os.kill(controller, signal.SIGSTOP)
    try:
        once = cluster.cli("status", "--name", cluster.name, "--timeout", "3", check=False, timeout=120)
        watch = cluster.cli(
            "status", "--watch", "1", "--timeout", "3", "--name", cluster.name, check=False, timeout=120
        )
    finally:
        os.kill(controller, signal.SIGCONT)
    for done in (once, watch):
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            "pdcluster: the controller did not answer in 3 s: its process may be stopped or overloaded "
            "(`pdcluster down` stops the cluster all the same)"
        )
    assert cluster.status()["controller_restarts"] == 2  # continued, it answers: nothing was restarted


def decodes(status: dict) -> list[dict]:
    return [r for r in status["replicas"] if r["role"] == "decode"]
