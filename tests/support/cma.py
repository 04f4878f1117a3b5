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
from pathlib import Path

import pytest

# A child reads its parent's memory through the backend's own copy (cma.copy): what a producer
# and a consumer do, neither a descendant of the other (Yama's ptrace_scope 1 allows a process
# its descendants only).
READ_PARENT = """
import sys
import numpy as np
from pdcluster.kv_transfer.transports import cma
pid, address = int(sys.argv[1]), int(sys.argv[2])
out = np.zeros(8, dtype=np.uint8)
try:
    cma.copy(pid, np.array([[out.ctypes.data, 8]], dtype=np.uint64), np.array([[address, 8]], dtype=np.uint64))
except OSError as exc:
    sys.exit(exc.strerror)
sys.stdout.write(out.tobytes().decode())
"""
REPO = Path(__file__).resolve().parents[2]


@functools.cache
def cross_process_copies_refused() -> str | None:
    """Why a process may not read another's memory here, or None where it may."""
    probe = ctypes.create_string_buffer(b"cma-prob", 8)
    child = subprocess.run(
        [sys.executable, "-c", READ_PARENT, str(os.getpid()), str(ctypes.addressof(probe))],
        cwd=REPO,
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
