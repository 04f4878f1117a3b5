"""The test-host harness (tests/support/hosts.py): hosts that pdcluster tells apart, that reach
each other on their bridge, that can be cut off and killed, and that leave nothing behind."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engines import REPO
from tests.support.hosts import make_hosts, uplink_of

NODE_ID = "from pdcluster.kv_transfer.transports.selection import node_id; print(node_id())"
SERVE = "import socket; s = socket.create_server(('0.0.0.0', 7000)); print('up', flush=True); c, a = s.accept(); print(a[0], flush=True)"
DIAL = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=5).close()"


def python(host, code: str, *args: str) -> subprocess.CompletedProcess:
    return host.run(sys.executable, "-c", code, *args)


def serving(host) -> subprocess.Popen:
    """A server on `host`'s port 7000, listening once this returns; it accepts one connection and
    prints where it came from."""
    server = host.popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert server.stdout.readline().strip() == "up"
    return server


def test_hosts_are_different_machines_to_pdcluster_and_reach_each_other():
    with make_hosts(2) as (one, two):
        subnet = one.address.rsplit(".", 1)[0]
        assert subnet.startswith("198.18.") and (one.address, two.address) == (f"{subnet}.11", f"{subnet}.12")
        assert one.run("hostname").stdout.strip() == one.name
        ids = {python(host, NODE_ID).stdout.strip() for host in (one, two)}
        assert len(ids) == 2  # not the same node: shm is never chosen between them
        one.run("sh", "-c", "echo x > /dev/shm/pdcluster-probe")
        assert two.run("ls", "/dev/shm").stdout.split() == []  # a private /dev/shm each
        server = serving(two)
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
        made = {"netns": [h.name for h in hosts] + [hosts[0].switch], "links": [uplink_of(hosts[0].switch)]}
        made["hosts"] = hosts
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


def forward_drop_table() -> str | None:
    """Where bridged IPv4 traffic passes this machine's firewall (br_netfilter on, nft at hand),
    a table name free for a forward-drop test; None otherwise."""
    switch = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not shutil.which("nft") or not switch.exists() or switch.read_text().strip() != "1":
        return None
    return f"pdcluster_fwd_{secrets.token_hex(3)}"


def test_hosts_reach_each_other_where_this_machine_drops_forwarded_traffic():
    """A Docker host's firewall: bridged traffic passes it (br_netfilter) and its FORWARD policy
    drops what no rule accepts. The hosts' bridge is not this machine's to filter: they reach each
    other, and this machine reaches them. The drop here is this machine's, scoped to the test
    range (198.18.0.0/15), and removed after."""
    table = forward_drop_table()
    if table is None:
        pytest.skip("bridged traffic does not pass this machine's firewall here (no br_netfilter) or no nft")
    chain = "{ type filter hook forward priority 0; }"
    subprocess.run(["nft", "add", "table", "inet", table], check=True, timeout=30)
    try:
        subprocess.run(["nft", "add", "chain", "inet", table, "pdfwd", chain], check=True, timeout=30)
        drop = ["ip", "saddr", "198.18.0.0/15", "ip", "daddr", "198.18.0.0/15", "counter", "drop"]
        subprocess.run(["nft", "add", "rule", "inet", table, "pdfwd", *drop], check=True, timeout=30)
        with make_hosts(2) as (one, two):
            server = serving(two)
            dialed = one.run(sys.executable, "-c", DIAL, two.address, check=False)
            assert dialed.returncode == 0, dialed.stderr  # host to host
            assert server.stdout.readline().strip() == one.address
            server.wait(10)
            server = serving(two)
            subprocess.run([sys.executable, "-c", DIAL, two.address], check=True, timeout=30)  # this machine
            server.wait(10)
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], check=True, timeout=30)
