"""Test hosts on one machine: each a network namespace on a bridge of its own (addresses from the
benchmarking range 198.18.0.0/15 only), with its own hostname, IPC, mount (a private /dev/shm)
and PID namespace, so that pdcluster's node identity sees different hosts, the same-host shm path
cannot be taken between them, and killing a host ends exactly its processes. The bridge is a
switch in a network namespace of its own, which this machine joins through a link of its own
(the tests reach the hosts through it): traffic between hosts never crosses this machine's
firewall, which on a Docker host (br_netfilter, FORWARD policy drop) would cut them off.

Each host is an init process (`sleep infinity`, PID 1 of the host's PID namespace) made by
`ip netns exec <ns> unshare ...`; commands run inside it through `nsenter` into all of its
namespaces. `make_hosts(n)` is a context manager: every namespace, link and process it made (by
pid) is removed when it exits, also when the test fails. Needs root (as on CI and the dev
machines); `require_root()` skips a test with that reason otherwise. ../shared/notes/
multinode-netns.md has what was measured on this kernel (no netem; nftables and tbf exist).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdcluster.orchestrator.session import WORKERS_AT_NORMAL_PRIORITY

SUBNET = "198.18.{group}.{host}"  # 198.18.0.0/15: RFC 2544 benchmarking addresses, never routed
PREFIX = 24
SHM_BYTES = 512 << 20
RAY_DIR = "/tmp/ray"  # Ray's default state directory, private to each host
RAY_DIR_BYTES = 2 << 30
RAY_ENV = ("env", f"RAY_TMPDIR={Path(RAY_DIR).parent}")
RAY_STARTED = "Ray runtime started"
RAY_SLOW_START = "The current node timed out during startup"  # ray/_private/node.py

logger = logging.getLogger(__name__)


CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21  # linux/capability.h


def has_capabilities(*caps: int) -> bool:
    """Whether this process holds every capability in `caps` (root in an unprivileged container,
    Docker's default, lacks CAP_NET_ADMIN and CAP_SYS_ADMIN)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    effective = int(next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0"), 16)
    return all(effective >> cap & 1 for cap in caps)


def require_root() -> None:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("test hosts need root and iproute2/util-linux (ip, unshare, nsenter)")
    if not has_capabilities(CAP_NET_ADMIN, CAP_SYS_ADMIN):
        pytest.skip("test hosts need CAP_NET_ADMIN and CAP_SYS_ADMIN (root in an unprivileged container lacks them)")


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    name: str  # also its hostname and network namespace
    address: str
    init_pid: int  # PID 1 of its PID namespace, as this machine sees it
    veth: str  # the switch side of its link (down: the host is cut off)
    switch: str  # the network namespace its bridge lives in

    def command(self, *argv: str) -> list[str]:
        """argv run inside this host (all of its namespaces). Ray's state goes in the host's own
        RAY_DIR whatever TMPDIR says (Ray puts it under RAY_TMPDIR, else TMPDIR, else /tmp)."""
        return ["nsenter", "-t", str(self.init_pid), "-n", "-u", "-i", "-m", "-p", "--", *RAY_ENV, *argv]

    def run(self, *argv: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*argv), capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(*argv), **kwargs)

    def cut(self, down: bool = True) -> None:
        """Partition the host from the others (its link down), or heal it."""
        _run("ip", "-n", self.switch, "link", "set", self.veth, "down" if down else "up")

    def kill(self) -> None:
        """The host goes away: its init dies, and with it every process of its PID namespace."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)

    def start_ray(
        self,
        head: Host | None = None,
        *,
        port: int = 6379,
        num_cpus: int = 1,
        labels: dict[str, str] | None = None,
        resources: dict[str, float] | None = None,
        object_store_bytes: int = 100 << 20,
    ) -> subprocess.Popen:
        """A Ray node on this host (`ray start --block`): the head (head=None, on `port`) or a
        node joining `head`'s; returns once Ray says it started. It ends with the host."""
        ray = str(Path(sys.executable).with_name("ray"))
        # Workers at normal priority, as `up`'s own head runs them: a test host stands in for a
        # machine of its own, but shares this one's cores with the other test lane's clusters; at
        # Ray's default (nice 15) its replicas starved beside them (an engine start took minutes).
        priority = [f"{name}={value}" for name, value in WORKERS_AT_NORMAL_PRIORITY.items()]
        argv = ["env", *priority, ray, "start", "--block", f"--node-ip-address={self.address}"]
        argv += [f"--num-cpus={num_cpus}"]
        argv += [f"--object-store-memory={object_store_bytes}", "--disable-usage-stats"]
        if head is None:
            argv += ["--head", f"--port={port}", "--include-dashboard=false"]
        else:
            argv += [f"--address={head.address}:{port}"]
        if labels:
            argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if resources:
            argv.append("--resources=" + json.dumps(resources))
        node, seen = self._ray_start(argv)
        if node is None and any(RAY_SLOW_START in line for line in seen):
            # Ray gives a raylet a fixed 30 s to register with the GCS; on a loaded machine that
            # can pass. What the attempt started on this host is stopped, then it starts once more.
            self.run(ray, "stop", "--force", timeout=120, check=False)
            node, seen = self._ray_start(argv)
        if node is None:
            raise AssertionError(f"ray start on {self.name} failed: {''.join(seen[-20:])}")
        return node

    def _ray_start(self, argv: list[str]) -> tuple[subprocess.Popen | None, list[str]]:
        """The running `ray start --block` once Ray says it started (None: it exited), and what
        it printed until then."""
        node = self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in node.stdout:  # await Ray's own "started" message
            seen.append(line)
            if RAY_STARTED in line:
                # What it prints later is read on (a full pipe would block it).
                threading.Thread(target=node.stdout.read, daemon=True).start()
                return node, seen
        seen.append(f"(exit code {node.wait()})")
        return None, seen

    def pids(self, marker: str) -> list[int]:
        """Pids (as this machine sees them) of the host's live processes whose command line
        contains `marker`."""
        namespace = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        return [
            pid
            for pid, cmdline in live_processes(lambda pid: os.readlink(f"/proc/{pid}/ns/pid") == namespace)
            if marker.encode() in cmdline
        ]

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.init_pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"
        except (FileNotFoundError, IndexError):
            return False


def live_processes(belongs: Callable[[int], bool]) -> Iterator[tuple[int, bytes]]:
    """(pid, raw command line) of this machine's live processes (not zombies, not this one) that
    `belongs(pid)` accepts; processes that exit meanwhile, or are not ours to inspect (a
    container's own), are passed over."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            if not belongs(pid):
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
            continue
        yield pid, cmdline


@contextlib.contextmanager
def _free_group() -> Iterator[int]:
    """The lowest subnet group (198.18.<group>.0/24) no other make_hosts on this machine holds
    (test lanes run at once, tools/test_lanes.py); held, by an flock, until the hosts are gone."""
    for group in range(256):
        path = Path(tempfile.gettempdir()) / f"pdcluster-test-hosts-{group}.lock"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield group
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError("all 256 test host subnets (198.18.0-255.0/24) are held")


@contextlib.contextmanager
def make_hosts(count: int, keep_logs: Path | None = None) -> Iterator[list[Host]]:
    """`count` hosts at 198.18.<group>.11, .12, ... (a group free on this machine) on a fresh
    bridge; all removed on exit. `keep_logs`: where each host's Ray session logs (the controller's
    and the replicas' among them) are copied, to `keep_logs/<address>`, before the host and its
    private Ray directory go."""
    require_root()
    with _free_group() as group:
        yield from _make_hosts(count, group, keep_logs)


def keep_ray_logs(host: Host, into: Path) -> None:
    """Copy `host`'s latest Ray session's logs to `into/<address>` (nothing where no Ray ran).
    Its /tmp/ray is a mount of its own: read through its init's root."""
    ray_dir = Path(f"/proc/{host.init_pid}/root") / RAY_DIR.lstrip("/")
    try:
        session = ray_dir / os.path.basename(os.readlink(ray_dir / "session_latest"))
    except OSError:
        return  # no Ray session on this host
    try:
        shutil.copytree(session / "logs", into / host.address, symlinks=True, dirs_exist_ok=True)
    except (OSError, shutil.Error) as exc:  # a failed copy must not keep the hosts alive
        logger.warning("could not keep the Ray logs of %s: %s", host.name, exc)


def uplink_of(switch: str) -> str:
    """This machine's side of its link to `switch` (the other links live in the switch's and the
    hosts' namespaces, and go with them)."""
    return f"{switch}up"


def _make_hosts(count: int, group: int, keep_logs: Path | None = None) -> Iterator[list[Host]]:
    tag = secrets.token_hex(2)
    switch, bridge = f"pd{tag}sw", "br0"
    uplink = uplink_of(switch)
    made_links: list[str] = []
    made_netns: list[str] = []
    inits: list[subprocess.Popen] = []
    hosts: list[Host] = []
    try:
        _run("ip", "netns", "add", switch)
        made_netns.append(switch)
        _run("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
        _run("ip", "-n", switch, "link", "set", bridge, "up")
        # This machine's link to the switch, with the group's first address.
        _run("ip", "link", "add", uplink, "type", "veth", "peer", "name", "up0", "netns", switch)
        made_links.append(uplink)
        _run("ip", "-n", switch, "link", "set", "up0", "master", bridge, "up")
        _run("ip", "addr", "add", f"{SUBNET.format(group=group, host=1)}/{PREFIX}", "dev", uplink)
        _run("ip", "link", "set", uplink, "up")
        for i in range(1, count + 1):
            name, veth = f"pd{tag}h{i}", f"pv{tag}h{i}"
            address = SUBNET.format(group=group, host=10 + i)
            _run("ip", "netns", "add", name)
            made_netns.append(name)
            _run("ip", "-n", switch, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "-n", switch, "link", "set", veth, "master", bridge, "up")
            _run("ip", "-n", name, "addr", "add", f"{address}/{PREFIX}", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            # Its own /dev/shm, and its own Ray state directory (sockets, session): two Ray
            # nodes on one filesystem would otherwise share /tmp/ray's session paths.
            setup = (
                f"hostname {name} && mount -t tmpfs -o size={SHM_BYTES},mode=1777 tmpfs /dev/shm && "
                f"mkdir -p {RAY_DIR} && mount -t tmpfs -o size={RAY_DIR_BYTES},mode=1777 tmpfs {RAY_DIR} && "
                "exec sleep infinity"
            )
            init = subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--uts", "--ipc", "--mount", "--propagation", "private",
                 "--pid", "--mount-proc", "--fork", "sh", "-c", setup],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            inits.append(init)
            host = Host(name, address, _init_pid(init), veth, switch)
            hosts.append(host)
            _await_setup(host, init)
        yield hosts
    finally:
        for host in hosts:
            if keep_logs is not None:
                keep_ray_logs(host, keep_logs)
            host.kill()
        for init in inits:
            with contextlib.suppress(ProcessLookupError):
                init.kill()
            init.wait(30)
            if init.stderr is not None:
                init.stderr.close()
        for name in made_netns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for link in reversed(made_links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


def _init_pid(launcher: subprocess.Popen) -> int:
    """The pid (in this machine's PID namespace) of the host's PID 1: the only child of the
    `unshare --fork` that `ip netns exec` became."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.stderr.read().decode() if launcher.stderr else "host init exited"
        try:
            with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
                children = f.read().split()
        except FileNotFoundError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)  # poll interval: the fork has not happened yet
    raise AssertionError("a test host's init did not start")


def _await_setup(host: Host, launcher: subprocess.Popen) -> None:
    """Until the init runs `sleep` (its hostname and /dev/shm are in place)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.stderr.read().decode() if launcher.stderr else "host init exited"
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{host.init_pid}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep"):
                    return
        time.sleep(0.01)  # poll interval: the setup commands are still running
    raise AssertionError(f"test host {host.name} did not finish its setup")
