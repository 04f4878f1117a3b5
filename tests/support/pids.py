"""A process started with a given pid, free again: how tests make a pid reuse happen on purpose
(the kernel's next pid, ns_last_pid, is set just before a start). Needs root outside a container;
elsewhere the tests that need it are skipped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"  # the pid the kernel gave last: the next is one past it


def skip_unless_pids_can_be_reused() -> None:
    try:
        with open(NS_LAST_PID, "w") as f:  # what start_with_pid does
            f.write(Path(NS_LAST_PID).read_text())
    except OSError as exc:
        pytest.skip(f"{NS_LAST_PID} cannot be written here ({exc.strerror}): no pid is given again on purpose")


def start_with_pid(pid: int, tries: int = 50) -> subprocess.Popen:
    """A process given `pid` (free again): the kernel's next pid set to it, then a start. Fails
    the test where no try got it (another process's start took it first each time)."""
    for _ in range(tries):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        process = subprocess.Popen(["sleep", "600"])
        if process.pid == pid:
            return process
        process.kill()
        process.wait(timeout=30)
    pytest.fail(f"no process started with pid {pid} again in {tries} tries")
