"""`pdcluster up` joins a Ray cluster someone else started (here: `ray start --head` on
127.0.0.1 by the test), places its actors there, serves in aggregated mode, and `down` stops
only what pdcluster started: the external head keeps running."""

from __future__ import annotations

import subprocess

import openai
import pytest

from pdcluster.orchestrator.session import free_port, process_group_alive, ray_command, stop_process_group
from tests.support.cluster import cli, require_clusters_lane, write_config

pytestmark = pytest.mark.e2e


@pytest.fixture
def external_head(tmp_path):
    require_clusters_lane()
    port = free_port()
    proc = subprocess.Popen(
        [
            *ray_command(),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--num-cpus=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    for line in proc.stdout:  # await the head's own "started" message
        if b"Ray runtime started" in line:
            break
    else:
        pytest.fail(f"ray start exited with {proc.wait()}")
    yield f"127.0.0.1:{port}", proc
    stop_process_group(proc.pid)
    proc.wait(30)


def test_up_joins_existing_ray_cluster(tmp_path, external_head):
    address, head = external_head
    config = write_config(
        tmp_path / "join.yaml",
        name="e2e-join",
        mode="aggregated",
        ray={"address": address},
        roles={"aggregated": {"replicas": 1, "cpu_bind": ["0"]}},
    )
    up = cli(tmp_path, "up", str(config))
    assert f"joining Ray cluster at {address}" in up.stdout
    endpoint = up.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    try:
        import ray

        ray.init(address=address, namespace="pdcluster", log_to_driver=False)
        try:
            # The controller, router and replica actors live in the cluster we started.
            assert ray.get(ray.get_actor("e2e-join-controller").ping.remote()) == "ok"
            assert ray.get(ray.get_actor("e2e-join-router").inflight.remote()) == {"aggregated-0": 0}
            assert ray.get(ray.get_actor("e2e-join-aggregated-0").info.remote())["stage"] == "ready"
            assert len([n for n in ray.nodes() if n["Alive"]]) == 1  # the head the test started
        finally:
            ray.shutdown()

        status = cli(tmp_path, "status", "--json", "--name", "e2e-join").stdout
        assert '"mode": "aggregated"' in status and '"state": "ready"' in status
        client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0)
        text = (
            client.completions.create(model="tiny", prompt="import os\n", max_tokens=8, temperature=0).choices[0].text
        )
        assert text
    finally:
        cli(tmp_path, "down", "--name", "e2e-join", timeout=300)
    assert head.poll() is None and process_group_alive(head.pid)  # the external head still runs
    ray_status = subprocess.run(
        [*ray_command(), "status", f"--address={address}"], capture_output=True, text=True, timeout=120
    )
    assert ray_status.returncode == 0
