"""Whether this machine lets a process copy another's memory (process_vm_readv / writev), which
the shm backend's direct path needs both ways. A container without CAP_SYS_PTRACE (Docker's
default seccomp profile) or Yama's ptrace_scope >= 1 for a non-root user refuses it; the backend
then uses its shared-memory ring (cma.py). Tests of the direct path skip there, saying why."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

import pytest

# A child reads its parent's memory: what a producer and a consumer do, neither a descendant of
# the other (Yama's ptrace_scope 1 allows a process its descendants only).
READ_PARENT = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, address = int(sys.argv[1]), int(sys.argv[2])
out = ctypes.create_string_buffer(8)
local = (ctypes.c_void_p * 2)(ctypes.addressof(out), 8)
remote = (ctypes.c_void_p * 2)(address, 8)
libc.process_vm_readv.restype = ctypes.c_ssize_t
if libc.process_vm_readv(pid, local, 1, remote, 1, 0) != 8:
    sys.exit(os.strerror(ctypes.get_errno()))
sys.stdout.write(out.raw.decode())
"""


@functools.cache
def cross_process_copies_refused() -> str | None:
    """Why a process may not read another's memory here, or None where it may."""
    probe = ctypes.create_string_buffer(b"cma-prob", 8)
    child = subprocess.run(
        [sys.executable, "-c", READ_PARENT, str(os.getpid()), str(ctypes.addressof(probe))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if child.returncode == 0 and child.stdout == probe.raw.decode():
        return None
    return f"process_vm_readv of another process refused here ({child.stderr.strip() or child.stdout!r})"


def skip_unless_cross_process_copies() -> None:
    reason = cross_process_copies_refused()
    if reason:
        pytest.skip(f"{reason}: no direct shm path (a container needs CAP_SYS_PTRACE)")
