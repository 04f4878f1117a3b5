"""Run the real `pdcluster` CLI against real Ray for tests (each test cluster isolated by
PDCLUSTER_HOME and a router port of its own, chosen as the router binds)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.cores import FIRST, SECOND
from tests.support.engines import MODEL, REPO
from tests.support.hosts import Host, live_processes

PDCLUSTER = [sys.executable, "-m", "pdcluster.cli"]
TEST_DTYPE = "float32"


def write_config(path: Path, **overrides) -> Path:
    config = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    config["model"]["path"] = str(MODEL)
    config["model"]["max_model_len"] = 1024
    # Identity tests compare with a reference engine in float32, where P/D's different
    # computation order cannot flip a near-tie (tests/support/identity.py).
    config["model"]["dtype"] = TEST_DTYPE
    # Any free port, taken by the router as it binds (tests read the endpoint `up` prints): a port
    # picked here and bound later could be taken in between, as a source port of one of the
    # connections the Ray head opens meanwhile.
    config["router"]["port"] = 0
    # The tests' prompts are short: every one takes the P/D path, the subject of most tests,
    # unless a test sets conditional disaggregation itself (tests/e2e/test_planner.py).
    config["router"]["local_prefill_max_tokens"] = 0
    config["router"]["local_prefill_queue_tokens"] = 0
    for role in ("prefill", "decode", "aggregated"):
        config["roles"][role]["kv_cache_gib"] = 1
        # the default config's cores 0 and 1 as this machine's first two allowed ones
        cores = config["roles"][role].get("cpu_bind", [])
        config["roles"][role]["cpu_bind"] = [{"0": FIRST, "1": SECOND}.get(core, core) for core in cores]
    _merge(config, overrides)
    path.write_text(yaml.safe_dump(config))
    return path


def _merge(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def require_clusters_lane() -> None:
    """Ray clusters on this machine's network start in the clusters lane only
    (tools/test_lanes.py): two Ray heads on one network at once are not what these tests are
    about."""
    if os.environ.get("PDCLUSTER_TEST_LANE") == "engines":
        raise AssertionError("this module starts a Ray cluster: add it to CLUSTER_MODULES in tools/test_lanes.py")


def cli(
    home: Path,
    *args: str,
    timeout: float = 900,
    check: bool = True,
    host: Host | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`pdcluster ARGS` with its state in `home`; run inside test host `host` when given; `env`:
    variables set for it besides."""
    if args[:1] == ("up",) and host is None:  # a test host has a network of its own
        require_clusters_lane()
    argv, env = _command(home, args, host, env)
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"pdcluster {' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
        )
    return result


def _command(home: Path, args, host: Host | None, env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PDCLUSTER_HOME=str(home), PYTHONPATH=str(REPO), **(env or {}))
    return ([*PDCLUSTER, *args] if host is None else host.command(*PDCLUSTER, *args)), env


@dataclass
class RunningCluster:
    home: Path
    config_path: Path
    name: str
    endpoint: str
    host: Host | None = None  # the test host its CLI runs on (None: this machine)

    def cli(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return cli(self.home, *args, host=self.host, **kwargs)

    def popen(self, *args: str, **kwargs) -> subprocess.Popen:
        """`pdcluster ARGS` started, in a session of its own (stop_group ends it and what it started)."""
        argv, env = _command(self.home, args, self.host, None)
        return subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, **kwargs)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json", "--name", self.name).stdout)

    def routes(self) -> dict:
        """Disaggregated requests so far by path (pd, decode, local_prefill), as status shows them."""
        return self.status()["routes"]

    def wait_status(self, predicate, timeout_s: float, what: str) -> dict:
        """The first status `predicate` accepts; an AssertionError naming `what` after `timeout_s`."""
        # One `status --watch` for the wait: each `status` joins Ray anew (about a CPU-second, a
        # whole core's worth when polled every second on these 2 cores). It prints each change.
        watcher = self.popen("status", "--json", "--watch", "1", "--name", self.name, stdout=subprocess.PIPE, text=True)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            stop_group(watcher)  # its output ends: the loop below with it

        timer = threading.Timer(timeout_s, expire)
        timer.start()
        status = None
        try:
            for line in watcher.stdout:
                if predicate(status := json.loads(line)):
                    return status
        finally:
            timer.cancel()
            stop_group(watcher)
            watcher.stdout.close()
            watcher.wait()
        if not expired.is_set():  # why is on its stderr
            raise AssertionError(f"waiting for {what}: `status --watch` ended first (exit {watcher.returncode})")
        replicas = json.dumps(status["replicas"], default=str)[:3000] if status else "no status printed"
        raise AssertionError(f"timed out waiting for {what}: {replicas}")


def stop_group(process: subprocess.Popen) -> None:
    """End a process started in a session of its own, and what it started (a test host's
    nsenter forks the command it enters a PID namespace with)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def complete(http, prompt, **body):
    """A completion through the router's `http` client (4 tokens unless `body` says otherwise);
    it must succeed."""
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    return response


@contextlib.contextmanager
def cluster_up(home: Path, config_path: Path, host: Host | None = None) -> Iterator[RunningCluster]:
    name = yaml.safe_load(config_path.read_text())["name"]
    try:
        up = cli(home, "up", str(config_path), host=host)
    except BaseException:  # a failed up tears down itself; one killed at its timeout cannot
        cli(home, "down", "--name", name, timeout=300, check=False, host=host)
        raise
    endpoint = up.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    try:
        yield RunningCluster(home, config_path, name, endpoint, host)
    finally:
        cli(home, "down", "--name", name, timeout=300, check=False, host=host)


def cluster_processes(home: Path, markers: tuple[str, ...]) -> dict[int, str]:
    """Pid -> command line of the live processes (not zombies) of the cluster whose state is in `home`
    that contain any marker. A cluster's processes are told apart from every other one on the
    machine (another test's cluster, the tests' own engines) by the PDCLUSTER_HOME they inherit
    from the `up` that started Ray."""
    tag = f"PDCLUSTER_HOME={home}".encode()

    def of_this_cluster(pid: int) -> bool:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag in f.read().split(b"\0")

    found = {}
    for pid, raw in live_processes(of_this_cluster):
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
        if any(m in cmdline for m in markers):
            found[pid] = cmdline[:200]
    return found
