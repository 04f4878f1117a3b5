"""engine/lifetime.py: the processes below an engine's host die with their parent, the host itself
never arms the watch, and processes outside an engine are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

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


def start_host(code: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, psutil.Process, str]:
    host = subprocess.Popen([sys.executable, "-c", code, CHILD], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    pid, armed = host.stdout.readline().split()
    return host, psutil.Process(int(pid)), armed


def test_a_killed_hosts_engine_processes_exit():
    host, child, armed = start_host(HOST)
    assert armed == "True"
    host.send_signal(signal.SIGKILL)
    host.wait(10)
    child.wait(30)  # it ended itself (raises if it is still running), not left behind as an orphan
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
