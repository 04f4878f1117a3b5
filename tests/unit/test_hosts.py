"""The test-host harness (tests/support/hosts.py): hosts that pdcluster tells apart, that reach
each other on their bridge, that can be cut off and killed, and that leave nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.engines import REPO
from tests.support.hosts import make_hosts

NODE_ID = "from pdcluster.kv_transfer.transports.selection import node_id; print(node_id())"
SERVE = "import socket; s = socket.create_server(('0.0.0.0', 7000)); print('up', flush=True); c, a = s.accept(); print(a[0], flush=True)"
DIAL = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=5).close()"


def python(host, code: str, *args: str) -> subprocess.CompletedProcess:
    return host.run(sys.executable, "-c", code, *args)


def test_hosts_are_different_machines_to_pdcluster_and_reach_each_other():
    with make_hosts(2) as (one, two):
        subnet = one.address.rsplit(".", 1)[0]
        assert subnet.startswith("198.18.") and (one.address, two.address) == (f"{subnet}.11", f"{subnet}.12")
        assert one.run("hostname").stdout.strip() == one.name
        ids = {python(host, NODE_ID).stdout.strip() for host in (one, two)}
        assert len(ids) == 2  # not the same node: shm is never chosen between them
        one.run("sh", "-c", "echo x > /dev/shm/pdcluster-probe")
        assert two.run("ls", "/dev/shm").stdout.split() == []  # a private /dev/shm each
        server = two.popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert server.stdout.readline().strip() == "up"
        python(one, DIAL, two.address)
        assert server.stdout.readline().strip() == one.address  # it came from host one's address
        server.wait(10)
        two.cut()
        failed = one.run(sys.executable, "-c", DIAL, two.address, check=False)
        assert failed.returncode != 0  # partitioned
        two.cut(down=False)
        sleeper = two.popen(["sleep", "600"])
        two.kill()
        assert sleeper.wait(10) is not None and not two.alive()  # its processes died with it
        names = [one.name, two.name]
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in leftovers for name in names)


def test_a_failing_test_leaves_no_namespace_link_or_process():
    made = {}
    with pytest.raises(RuntimeError, match="the test failed"), make_hosts(2) as hosts:
        made = {"netns": [h.name for h in hosts], "links": [h.veth for h in hosts], "hosts": hosts}
        raise RuntimeError("the test failed")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert made and not any(name in netns for name in made["netns"])
    assert not any(veth in links for veth in made["links"])
    assert not any(host.alive() for host in made["hosts"])


def test_a_hosts_ray_logs_are_kept_before_the_host_goes(tmp_path):
    """A Ray session's logs live in the host's private /tmp/ray, gone with the host: make_hosts
    copies them out first (a session made by hand here: its layout is Ray's, a link
    session_latest to the session directory)."""
    made = (
        "mkdir -p /tmp/ray/session_1/logs && echo controller-log > /tmp/ray/session_1/logs/worker-1.out "
        "&& ln -s /tmp/ray/session_1 /tmp/ray/session_latest"
    )
    with make_hosts(2, keep_logs=tmp_path) as (one, two):
        one.run("sh", "-c", made)
    assert (tmp_path / one.address / "worker-1.out").read_text() == "controller-log\n"
    assert not (tmp_path / two.address).exists()  # no Ray ran there: nothing to keep
