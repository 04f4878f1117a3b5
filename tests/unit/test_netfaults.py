"""Network faults between test hosts (tests/support/netfaults.py), with real sockets across the
bridge: loss that TCP survives byte-exact, a partition that heals on exit, a delay relay that adds
latency and then gets out of the way. Each fault must leave no nft table or process behind.

Host one is the client (a decode host), host two serves on a port of the faulted range (a
prefill host). Root only, like test_hosts.py."""

from __future__ import annotations

import contextlib
import hashlib
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.hosts import Host, make_hosts
from tests.support.netfaults import delay, loss, partition, require_nft

PORTS = (47000, 47999)
PORT = 47123
SEED = 1234
BULK = 20 << 20
# Serves one connection per line of argv[2]: "bulk" sends BULK seeded bytes; "echo" reads until
# EOF and sends back what it read.
SERVE = f"""
import random, socket, sys
s = socket.create_server(('0.0.0.0', int(sys.argv[1])))
print('up', flush=True)
for mode in sys.argv[2].split(','):
    c, _ = s.accept()
    if mode == 'bulk':
        c.sendall(random.Random({SEED}).randbytes({BULK}))
    else:
        data = b''.join(iter(lambda: c.recv(1 << 16), b''))
        c.sendall(data)
    c.close()
"""
# Dials argv[1]:argv[2], sends argv[3] seeded bytes and half-closes, prints the sha256 of what came
# back and the seconds from the first byte sent to the last byte received.
DIAL = """
import hashlib, random, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
payload = random.Random(int(sys.argv[3])).randbytes(int(sys.argv[3]))
start = time.monotonic()
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
data = b''.join(iter(lambda: c.recv(1 << 16), b''))
print(hashlib.sha256(data).hexdigest(), time.monotonic() - start)
"""


@contextlib.contextmanager
def serving(host: Host, port: int, *modes: str) -> Iterator[subprocess.Popen]:
    server = host.popen([sys.executable, "-c", SERVE, str(port), ",".join(modes)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        yield server
        assert server.wait(30) == 0
    finally:
        server.kill()
        server.wait(10)
        server.stdout.close()


def dial(client: Host, server: Host, port: int, send: int = 0, timeout: float = 30) -> tuple[str, float]:
    done = client.run(sys.executable, "-c", DIAL, server.address, str(port), str(send), str(timeout), timeout=120)
    digest, seconds = done.stdout.split()
    return digest, float(seconds)


def fails_to_dial(client: Host, server: Host, port: int) -> bool:
    return client.run(sys.executable, "-c", DIAL, server.address, str(port), "0", "1", check=False).returncode != 0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_clean(host: Host) -> None:
    """No nft table left in the host, and no process but its init."""
    assert host.run("nft", "list", "tables").stdout.strip() == ""
    others = (
        "import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())))"
    )
    assert host.run(sys.executable, "-c", others).stdout.strip() == "[]"


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with make_hosts(2) as (one, two):
        require_nft(one)
        yield one, two


def test_loss_drops_packets_and_tcp_still_delivers_byte_exact(hosts):
    one, two = hosts
    with serving(two, PORT, "bulk"), loss(one, two.address, PORTS, percent=5) as rules:
        digest, _ = dial(one, two, PORT)
        dropped = rules.packets()
    assert digest == sha(random.Random(SEED).randbytes(BULK))
    assert dropped > 0
    assert_clean(one)


def test_partition_cuts_the_peer_off_until_exit(hosts):
    one, two = hosts
    with serving(two, PORT, "echo", "echo"), serving(two, 7000, "echo"), serving(one, PORT, "echo"):
        with partition(one, two.address) as rules:
            assert fails_to_dial(one, two, PORT)
            assert fails_to_dial(two, one, PORT)  # both directions
            assert rules.packets() > 0
        dial(one, two, PORT)
        dial(two, one, PORT)
        with partition(one, two.address, ports=PORTS):
            assert fails_to_dial(one, two, PORT)
            dial(one, two, 7000)  # other ports still pass
        dial(one, two, PORT)
    assert_clean(one)


@pytest.mark.parametrize("fault", [loss, partition, delay])
def test_a_fault_undoes_itself_when_the_body_raises(hosts, fault):
    one, two = hosts
    with pytest.raises(RuntimeError, match="the test failed"), fault(one, two.address, PORTS):
        assert one.run("nft", "list", "tables").stdout.strip() != ""
        raise RuntimeError("the test failed")
    assert_clean(one)


def test_delay_adds_latency_per_direction_and_goes_away_on_exit(hosts):
    one, two = hosts
    ms, size = 100, 1 << 20
    expected = sha(random.Random(size).randbytes(size))
    with serving(two, PORT, "echo", "echo"):
        with delay(one, two.address, PORTS, ms=ms) as relay:
            digest, seconds = dial(one, two, PORT, send=size)
            assert relay.await_connections(1) == 1
        assert digest == expected
        assert seconds >= 2 * ms / 1000  # there and back, each held ms (a lower bound only)
        assert relay.process.returncode == 0
        digest, _ = dial(one, two, PORT, send=size)  # direct now: no redirect to a relay that is gone
        assert digest == expected and relay.connections == 1
    assert_clean(one)


def test_delay_refused_upstream_fails_the_client_like_a_direct_dial(hosts):
    one, two = hosts
    with delay(one, two.address, PORTS, ms=10) as relay:
        assert fails_to_dial(one, two, PORT)  # nothing listens there
        assert relay.await_connections(1) == 1
    assert_clean(one)
