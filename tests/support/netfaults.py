"""Network faults between test hosts (tests/support/hosts.py), each a context manager that undoes
itself on exit, also when the test body raises.

The kernel here has nf_tables but no netem (../shared/notes/multinode-netns.md), so:
- `loss` and `partition` are nftables drop rules in one host's namespace, in a table of their own
  that exit deletes; rules carry a `counter`, so a test can show the fault really bit.
- `delay` is a user-space relay: an nft NAT rule in the host redirects its connections to the
  peer's ports to a small asyncio relay inside the host, which dials the original destination
  (its own connection marked, so not redirected again) and releases each chunk `ms` after it
  arrived, in order: latency, not a bandwidth cap.

Ports are TCP, given as an inclusive `(lo, hi)` range. `host` is the side whose namespace gets
the rules; for `loss` and `delay` it is the client of `peer_address`'s ports (a decode host
pulling KV from a prefill host), for `partition` without ports the direction does not matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import secrets
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.hosts import Host

Ports = tuple[int, int]
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a NAT-redirected connection was going
SO_MARK = 36  # asm-generic/socket.h
RELAY_MARK = 0x70D  # the relay's own upstream connections carry it and are not redirected
READY_TIMEOUT = 30.0


def require_nft(host: Host) -> None:
    """Skip the test when `nft` (Debian package `nftables`) is not installed."""
    if host.run("sh", "-c", "command -v nft", check=False).returncode != 0:
        pytest.skip("network faults need nft (apt-get install nftables)")


@dataclass
class Rules:
    """An nft table in `host`'s namespace, deleted on exit."""

    host: Host
    family: str
    table: str

    def packets(self) -> int:
        """Packets the table's rule counters have seen (for drop rules: dropped)."""
        listing = json.loads(self.host.run("nft", "-j", "list", "table", self.family, self.table).stdout)
        return sum(
            expr["counter"]["packets"]
            for item in listing["nftables"]
            for expr in item.get("rule", {}).get("expr", [])
            if "counter" in expr
        )


@contextlib.contextmanager
def _table(host: Host, family: str, chains: dict[str, tuple[str, list[str]]]) -> Iterator[Rules]:
    """A fresh table with `chains` ({name: (type/hook/priority, [rule, ...])}), loaded atomically
    (`nft -f -`) and deleted on exit unless the host (and with it its namespace) has gone."""
    rules = Rules(host, family, f"pdfault_{secrets.token_hex(3)}")
    script = [f"table {family} {rules.table} {{"]
    for name, (hook, body) in chains.items():
        script += [f"  chain {name} {{", f"    {hook}; policy accept;", *(f"    {r}" for r in body), "  }"]
    script.append("}")
    loaded = subprocess.run(
        host.command("nft", "-f", "-"), input="\n".join(script) + "\n", capture_output=True, text=True, timeout=30
    )
    if loaded.returncode != 0:
        raise RuntimeError(f"nft refused the rules in {host.name}: {loaded.stderr.strip()}")
    try:
        yield rules
    finally:
        if host.alive():
            host.run("nft", "delete", "table", family, rules.table, timeout=30)


def _ip(peer_address: str) -> str:
    return "ip6" if ipaddress.ip_address(peer_address).version == 6 else "ip"


def _range(ports: Ports) -> str:
    lo, hi = ports
    assert 0 < lo <= hi < 65536, ports
    return str(lo) if lo == hi else f"{lo}-{hi}"


@contextlib.contextmanager
def _drops(host: Host, peer_address: str, ports: Ports | None, percent: int) -> Iterator[Rules]:
    ip = _ip(peer_address)
    chance = f"numgen random mod 100 < {percent} " if percent < 100 else ""
    sport = f"tcp sport {_range(ports)} " if ports else ""
    dport = f"tcp dport {_range(ports)} " if ports else ""
    chains = {
        "input": ("type filter hook input priority 0", [f"{ip} saddr {peer_address} {sport}{chance}counter drop"]),
        "output": ("type filter hook output priority 0", [f"{ip} daddr {peer_address} {dport}{chance}counter drop"]),
    }
    with _table(host, "inet", chains) as rules:
        yield rules


@contextlib.contextmanager
def loss(host: Host, peer_address: str, ports: Ports, percent: int = 5) -> Iterator[Rules]:
    """Drop `percent`% of the packets `host` exchanges with `peer_address`'s TCP `ports`: in from
    them (saddr + sport) and out to them (daddr + dport). TCP must retransmit; nothing is lost.
    Note that with GSO a "packet" here can be a 64 KiB super-packet."""
    assert 0 < percent < 100, percent
    with _drops(host, peer_address, ports, percent) as rules:
        yield rules


@contextlib.contextmanager
def partition(host: Host, peer_address: str, ports: Ports | None = None) -> Iterator[Rules]:
    """Drop everything between `host` and `peer_address` (or only `host`'s traffic with the
    peer's TCP `ports`), both directions, existing connections included, until exit."""
    with _drops(host, peer_address, ports, 100) as rules:
        yield rules


class Relay:
    """The delay relay as the test sees it: a process inside the host, its port, and how many
    connections it has relayed (one line per accepted connection on its stdout)."""

    def __init__(self, host: Host, ms: float, mark: int) -> None:
        argv = [sys.executable, __file__, host.address, str(ms), str(mark)]
        self.process = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port: int | None = None
        self.connections = 0
        self.ended = False  # its stdout closed: it exited
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"relay-{host.name}", daemon=True)
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self.port is not None or self.ended, READY_TIMEOUT)
        if self.port is None:
            self.stop()
            raise AssertionError(
                f"the delay relay in {host.name} did not get ready (exit status {self.process.poll()})"
            )

    def _read(self) -> None:
        for line in self.process.stdout:
            words = line.split()
            with self._changed:
                if words[:1] == ["ready"]:
                    self.port = int(words[1])
                elif words == ["connection"]:
                    self.connections += 1
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def await_connections(self, count: int, timeout: float = 10) -> int:
        """Until the relay has accepted at least `count` connections; returns how many it has."""
        with self._changed:
            self._changed.wait_for(lambda: self.connections >= count or self.ended, timeout)
            return self.connections

    def stop(self) -> None:
        """Closing its stdin ends the relay (and every connection through it)."""
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()  # nsenter only; the relay itself still ends on its stdin's EOF
            self.process.wait(10)
            raise
        finally:
            self._reader.join(10)
            self.process.stdout.close()


@contextlib.contextmanager
def delay(host: Host, peer_address: str, ports: Ports, ms: float = 50) -> Iterator[Relay]:
    """Add ~`ms` one-way delay, each direction, to the TCP connections `host` makes to
    `peer_address`'s `ports` from now until exit (IPv4). The client's connect completes at the
    relay at once; if the relay cannot reach the destination within 10 s it resets the client.
    Connections made before are not touched; those through the relay end when it stops on exit."""
    assert _ip(peer_address) == "ip", "SO_ORIGINAL_DST is IPv4 only"
    relay = Relay(host, ms, RELAY_MARK)
    try:
        redirect = (
            f"meta mark != {RELAY_MARK} ip daddr {peer_address} tcp dport {_range(ports)} "
            f"counter dnat to {host.address}:{relay.port}"
        )
        with _table(host, "ip", {"output": ("type nat hook output priority -100", [redirect])}):
            yield relay
    finally:
        relay.stop()


# The relay process: `python netfaults.py LISTEN_ADDRESS MS MARK`, run inside the host.


async def _relay_main(address: str, ms: float, mark: int) -> None:
    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction: chunks are released in order, each `ms` after its arrival;
        the reader keeps reading meanwhile (up to the queue's 64 MiB), so no serial sleeping."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)

        async def release() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(due - loop.time())
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        releaser = asyncio.create_task(release())
        try:
            while True:
                chunk = await reader.read(1 << 16)
                await queue.put((loop.time() + ms / 1000, chunk))
                if not chunk:
                    break
            await releaser
        finally:
            releaser.cancel()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        client = client_writer.get_extra_info("socket")
        raw = client.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        sys.stdout.write("connection\n")
        sys.stdout.flush()
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream.setblocking(False)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(upstream, (socket.inet_ntoa(packed), port)), 10
            )
        except OSError:  # refused, unreachable or timed out: reset the client, as its own dial would fail
            upstream.close()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client_writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(sock=upstream)
        pumps = [
            asyncio.create_task(pump(client_reader, upstream_writer)),
            asyncio.create_task(pump(upstream_reader, client_writer)),
        ]
        try:
            await asyncio.gather(*pumps)
        except OSError:  # one side reset (or failed): end the other side too, as a real path would
            for task in pumps:
                task.cancel()
        finally:
            for writer in (client_writer, upstream_writer):
                writer.close()

    server = await asyncio.start_server(handle, address, 0)
    loop = asyncio.get_running_loop()
    control = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
    sys.stdout.write(f"ready {server.sockets[0].getsockname()[1]}\n")
    sys.stdout.flush()
    await control.read()  # until the test closes our stdin (or dies)
    server.close()


if __name__ == "__main__":
    asyncio.run(_relay_main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
