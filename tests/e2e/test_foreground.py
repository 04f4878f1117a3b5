"""`pdcluster up`'s own process: `up --foreground` (what `make run` runs) ends at once, with exit 0,
when another shell runs `pdcluster down` (the foreground process stops the cluster itself); a
replica that fails to start is retried; ports taken by other processes are replaced or named."""

from __future__ import annotations

import os
import re
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdcluster.orchestrator.session import start_local_head, stop_process_group
from pdcluster.pidfds import group_running
from tests.support.cluster import PDCLUSTER, cli, require_clusters_lane, write_config
from tests.support.engines import REPO

pytestmark = pytest.mark.e2e


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    """The foreground's output up to the line containing `needle` (its readiness line)."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + timeout_s
    while needle not in seen:
        assert proc.poll() is None, f"up exited early:\n{seen}"
        assert time.monotonic() < deadline, f"no {needle!r} in time:\n{seen}"
        if selector.select(timeout=1.0):
            seen += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
    return seen


def test_down_from_another_shell_ends_a_foreground_up_with_exit_0(tmp_path):
    """Also: a disaggregated cluster of decode replicas alone (`roles.prefill.replicas: 0`, decode
    computes every prompt) is ready once its decode is (`up` once waited for a prefill too)."""
    name = "e2e-foreground"
    config = write_config(
        tmp_path / "cluster.yaml",
        name=name,
        roles={"aggregated": {"replicas": 0}, "prefill": {"replicas": 0}, "decode": {"replicas": 1}},
    )
    env = dict(os.environ, PDCLUSTER_HOME=str(tmp_path))
    require_clusters_lane()
    proc = subprocess.Popen(
        [*PDCLUSTER, "up", str(config), "--foreground"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        read_until(proc, "serving in the foreground", 600)
        down = cli(tmp_path, "down", "--name", name, timeout=400)
        assert "its foreground `up` shut it down" in down.stdout
        assert proc.wait(timeout=60) == 0  # it had already stopped when down returned
        rest = os.read(proc.stdout.fileno(), 1 << 20).decode(errors="replace")
        assert "Traceback" not in rest and "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            cli(tmp_path, "down", "--name", name, timeout=300, check=False)
    assert not list(tmp_path.glob("*.json"))


def engine_actor_processes() -> list[int]:
    """Pids of this machine's Ray actor processes hosting an aggregated replica (their title; a
    process Ray is still handing an actor to is titled ray::IDLE)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue  # gone, or not a process
        if title.startswith(b"ray::EngineActor"):
            pids.append(int(proc.name))
    return pids


def test_a_replica_that_fails_to_start_is_retried_in_its_slot(tmp_path):
    """An engine that cannot start (vLLM refuses its arguments) is started again in the same
    slot instead of being given up after one try, each failed actor's process is stopped (they
    once stayed, holding their CPUs, or a GPU, for good), and `up` shows the engine's reason (it
    once showed Ray's header naming the task); `up` then reports the cluster not ready in one
    line, and nothing is left behind. (One aggregated replica: the slot logic is the same for
    every role, and no healthy engine has to start beside it.)"""
    name = "e2e-retry"
    config = write_config(
        tmp_path / "cluster.yaml",
        name=name,
        mode="aggregated",
        roles={
            "aggregated": {"replicas": 1, "engine_args": {"max_num_batched_tokens": 0}},
            "prefill": {"replicas": 0},
            "decode": {"replicas": 0},
        },
    )
    require_clusters_lane()
    env = dict(os.environ, PDCLUSTER_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [*PDCLUSTER, "up", str(config)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        seen = read_until(proc, "aggregated-2", 600)  # aggregated-0 and -1 failed: the slot's third try
        alive = engine_actor_processes()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            cli(tmp_path, "down", "--name", name, timeout=300, check=False)
    stdout, stderr = seen + out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode != 0 and "Traceback" not in stderr + stdout
    # at most aggregated-1's, being killed (the third try's process is still ray::IDLE or new):
    # the two failed actors' processes once both stayed
    assert len(alive) <= 1, alive
    attempts = set(re.findall(r"(aggregated-\d+)\s+(?:starting|dead)", stdout))
    assert len(attempts) >= 2, stdout  # aggregated-0 failed, and its slot was tried again
    dead = re.findall(r"dead: (.*)", stdout)
    assert dead and all("max_num_batched_tokens" in line and "ray::" not in line for line in dead), dead
    assert stderr.strip().splitlines()[-1].startswith("pdcluster: "), stderr
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("ray_token_file", [False, True], ids=["", "stray-ray-token"])
def test_a_router_port_in_use_stops_up_in_one_line_naming_it(tmp_path, ray_token_file):
    """A router port another process holds stops `up` with one line that names `router.port`
    and the port (not the first line of a Ray traceback), and leaves no cluster behind (its Ray
    token file neither). With a token in ~/.ray/auth_token (any earlier plain `ray.init()`
    writes one), `ray start` turned Ray's token authentication on for the head while `up`
    joined it without: Ray refused `up` ("Authentication token is missing or incorrect") and
    every cluster on such a machine failed to start; the head now takes its own token."""
    env = {}
    if ray_token_file:
        home = tmp_path / "user"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("a-token-of-an-earlier-ray-init-" + "0" * 32)
        env["HOME"] = str(home)
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = write_config(tmp_path / "cluster.yaml", name="e2e-port-in-use", router={"port": port})
        result = cli(tmp_path, "up", str(config), timeout=300, check=False, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pdcluster: router.port") and str(port) in last and "in use" in last, result.stderr
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("*.ray-token"))


def test_a_ray_head_port_taken_before_ray_binds_it_is_replaced_by_another(tmp_path):
    """`up` picks the local Ray head's GCS port and Ray binds it seconds later; here another
    process holds it (as a connection's source port can take it meanwhile): the head that cannot
    bind it exits, and is started again on another free port instead of failing `up`."""
    require_clusters_lane()
    log = tmp_path / "head.log"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        address, pid = start_local_head(1, log, port=taken)
    try:
        assert group_running(pid)
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) != taken
        text = log.read_text(errors="replace")
        assert str(taken) in text and "Ray runtime started" in text  # the failed try, then the head
    finally:
        stop_process_group(pid)


STAND_IN_CONTROLLER = """
import sys, ray
ray.init(address=sys.argv[1], namespace="pdcluster", logging_level="ERROR")

class Controller:  # named and detached as `up` makes the controller; its shutdown fails
    def shutdown(self):
        raise RuntimeError("this controller cannot shut down")

    def ping(self):
        return "ok"

ray.remote(Controller).options(name=sys.argv[2], lifetime="detached").remote()
ray.get(ray.get_actor(sys.argv[2]).ping.remote())
"""

ACTOR_ALIVE = """
import sys, ray
ray.init(address=sys.argv[1], namespace="pdcluster", logging_level="ERROR")
try:
    ray.get(ray.get_actor(sys.argv[2]).ping.remote(), timeout=30)
    print("alive")
except (ValueError, ray.exceptions.RayActorError):
    print("gone")
"""


def test_down_kills_a_controller_whose_own_shutdown_fails(tmp_path, monkeypatch):
    """On a Ray cluster `up` joined (the head is not ours to stop), `down` asks the controller to
    shut down and that fails: the controller is killed all the same (its router and replicas, its
    own actors, go with it). It was left running while `down` said "stopped" and removed the
    record, so no later `down` could find it and the next `up` found its name taken."""
    from pdcluster.orchestrator.session import Session, controller_name

    require_clusters_lane()
    name = "e2e-down-stuck"
    address, head = start_local_head(None, tmp_path / "head.log")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        actor = controller_name(name)
        made = subprocess.run([sys.executable, "-c", STAND_IN_CONTROLLER, address, actor], env=env, timeout=120)
        assert made.returncode == 0
        monkeypatch.setenv("PDCLUSTER_HOME", str(tmp_path))
        Session(name, address, "pdcluster").save()  # joined: no head of its own
        down = cli(tmp_path, "down", "--name", name, timeout=300, check=False)
        assert down.returncode == 0 and "Traceback" not in down.stderr, down.stderr
        alive = subprocess.run(
            [sys.executable, "-c", ACTOR_ALIVE, address, actor], env=env, capture_output=True, text=True, timeout=120
        )
        assert alive.stdout.strip() == "gone", alive.stdout + alive.stderr[-2000:]
    finally:
        stop_process_group(head)
