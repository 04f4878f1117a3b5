"""engine/lifetime.py: the processes below an engine's host die with their parent, the host itself
never arms the watch, and processes outside an engine are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.support.engines import REPO

# A host (marked) starting a child that arms the watch, as vLLM's engine core does through our
# plugin; the child reports its pid and whether it armed, then idles.
HOST = """
import subprocess, sys
from pdcluster.engine.lifetime import die_with_parent, mark_host
mark_host()
assert not die_with_parent()  # never in the host itself
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
child.wait()
"""
CHILD = """
import os, time
from pdcluster.engine.lifetime import die_with_parent
print(os.getpid(), die_with_parent(), flush=True)
time.sleep(600)
"""


def start_host(
    code: str, env: dict[str, str] | None = None, child: str = CHILD
) -> tuple[subprocess.Popen, psutil.Process, str]:
    host = subprocess.Popen([sys.executable, "-c", code, child], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    pid, armed = host.stdout.readline().split()
    return host, psutil.Process(int(pid)), armed


# The same child with 1100 descriptors open before it arms the watch (its pidfd past 1024, where
# select() refused it: the watch's thread died and the child outlived its host).
MANY_FDS_CHILD = (
    "import os, resource\n"
    "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1200)), hard))\n"
    "held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n" + CHILD
)


@pytest.mark.parametrize("child_code", [CHILD, MANY_FDS_CHILD], ids=["few-fds", "fds-past-1024"])
def test_a_killed_hosts_engine_processes_exit(child_code):
    host, child, armed = start_host(HOST, child=child_code)
    assert armed == "True"
    host.send_signal(signal.SIGKILL)
    host.wait(10)
    child.wait(30)  # it ended itself (raises if it is still running), not left behind as an orphan
    assert not child.is_running()


# A child that arms the watch only once its host is gone (the window between vLLM's start-up
# handshake and our plugin loading): it had been reparented, and watched its new parent (init).
LATE_CHILD = """
import os, time
from pdcluster.pidfds import running
print(os.getpid(), "late", flush=True)
while running(int(os.environ["PDCLUSTER_ENGINE_HOST_PID"])):
    time.sleep(0.01)  # poll for the host's end
from pdcluster.engine.lifetime import die_with_parent
die_with_parent()
time.sleep(600)
"""


def test_a_process_whose_host_died_before_it_armed_the_watch_exits():
    host, child, _ = start_host(HOST, child=LATE_CHILD)
    host.send_signal(signal.SIGKILL)
    host.wait(10)
    child.wait(30)  # it ended itself (raises if it is still running)
    assert not child.is_running()


def test_processes_outside_an_engine_are_left_alone():
    plain = HOST.replace("mark_host()\n", "")
    env = {k: v for k, v in os.environ.items() if k != "PDCLUSTER_ENGINE_HOST_PID"}
    host, child, armed = start_host(plain, env)
    try:
        assert armed == "False"
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()


def test_vllms_sockets_go_to_the_engines_own_directory_and_leave_with_it(monkeypatch):
    """vLLM names its engine sockets ipc://$VLLM_RPC_BASE_PATH/<uuid> (by default in /tmp) and
    leaves them behind whenever a process ends without closing them; an engine host gives them a
    private directory that its stop() removes. An operator's own setting is left alone."""
    import asyncio
    import stat

    from vllm.utils.network_utils import get_open_zmq_ipc_path

    from pdcluster.engine.host import RPC_BASE_ENV, EngineHost, private_ipc_dir
    from tests.support.engines import tiny_engine

    monkeypatch.delenv(RPC_BASE_ENV, raising=False)
    host = EngineHost(tiny_engine("ipc-test"), "secret")
    host._ipc_dir = path = private_ipc_dir()
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert get_open_zmq_ipc_path().startswith(f"ipc://{path}/")  # vLLM reads it when it names one
    asyncio.run(host.stop())  # an engine that started nothing else stops all the same
    assert not os.path.exists(path) and RPC_BASE_ENV not in os.environ
    monkeypatch.setenv(RPC_BASE_ENV, "/run/operator-chosen")
    assert private_ipc_dir() is None and os.environ[RPC_BASE_ENV] == "/run/operator-chosen"
