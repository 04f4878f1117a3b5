"""Engine processes die with the process that hosts their engine.

vLLM starts an engine's core (and, where it keeps one, its worker) as child processes of the
process that created the AsyncLLM: our Ray actor. When that actor dies without shutting the
engine down (SIGKILL, or its Ray node going away, which makes Ray's workers exit), vLLM's children
are reparented to init and keep running, holding cores, memory and ports of a replica that no
longer exists. So every process below the engine's host watches its own parent through a pidfd
(a process, not a thread, as PR_SET_PDEATHSIG would be) and kills itself when the parent exits.

`mark_host()` runs in the hosting process before the engine starts; the descendants inherit the
marker and `die_with_parent()` (from our vLLM plugin, which vLLM loads in every process it
starts) arms the watch in each of them, never in the host itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading

from pdcluster.pidfds import exited

logger = logging.getLogger(__name__)

HOST_PID_ENV = "PDCLUSTER_ENGINE_HOST_PID"

_armed = False


def mark_host() -> None:
    """This process hosts an engine: the processes vLLM starts for it die with it."""
    os.environ[HOST_PID_ENV] = str(os.getpid())


def die_with_parent() -> bool:
    """In a descendant of a marked engine host: end this process (and with it, through their
    own watches, its children) as soon as its parent exits. True when the watch is armed."""
    global _armed
    host = os.environ.get(HOST_PID_ENV)
    if _armed or not host or not host.isdigit() or int(host) == os.getpid():
        return False
    # the process that started this one (a child of the host: the host): another parent by now
    # means it exited before the watch was armed, and this one was reparented (to init)
    starter = multiprocessing.parent_process()
    expected = starter.pid if starter is not None and starter.pid else int(host)
    parent = os.getppid()
    if parent != expected:
        _end(expected)
    try:
        pidfd = os.pidfd_open(parent)
    except OSError as exc:  # pidfds need Linux 5.3
        logger.warning("pid %d cannot watch its parent %d (%s): it may outlive it", os.getpid(), parent, exc)
        return False
    if os.getppid() != parent:  # the parent exited before the pidfd was opened
        _end(parent)
    threading.Thread(target=_watch, args=(pidfd, parent), name="pdcluster-die-with-parent", daemon=True).start()
    _armed = True
    return True


def _watch(pidfd: int, parent: int) -> None:
    exited(pidfd, None)  # returns once the parent process has exited
    _end(parent)


def _end(parent: int) -> None:
    logger.error("engine process %d: its parent %d exited without stopping it; exiting", os.getpid(), parent)
    os.kill(os.getpid(), signal.SIGKILL)
