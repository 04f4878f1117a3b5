"""Whether a process runs: held by a pidfd (readable once the process exited), or by its pid or
process group (signal 0); and which pid namespace a pid means something in (files named after
their writer's pid, swept once it is gone: engine/actor.py's secret files, shm segments).

poll(), not select(): select() refuses descriptors past 1024 (ValueError), and a process holding
many descriptors (connections to its ports, an engine's sockets) gets such numbers."""

from __future__ import annotations

import os
import select
from pathlib import Path


def exited(pidfd: int, timeout_s: float | None = 0) -> bool:
    """True once the process of `pidfd` exited, waiting up to timeout_s (None: until it does)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


def running(pid: int) -> bool:
    """Whether process `pid` runs in this pid namespace (another user's counts)."""
    return _signal_zero(os.kill, pid)


def group_running(pgid: int) -> bool:
    """Whether any process of group `pgid` runs (another user's counts)."""
    return _signal_zero(os.killpg, pgid)


def _signal_zero(send, target: int) -> bool:
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def pid_namespace() -> str:
    """This process's pid namespace: its inode and the kernel's boot id (two machines sharing a
    TMPDIR have the same inode for their initial namespaces); "" where /proc does not say."""
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
    except OSError:
        return ""
    return f"{boot}{inode}"
