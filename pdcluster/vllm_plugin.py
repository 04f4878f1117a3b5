"""vLLM general plugin: process-level fixes every vLLM process of ours needs.

vLLM loads `vllm.general_plugins` entry points in each process it starts (API process, engine
core, workers) before a model runs, so this is the one place for per-process platform fixes.

- Logging: the `pdcluster` logger gets a handler in engine processes vLLM spawns.
- AMX permission (x86_64 Linux): vLLM's CPU attention kernel executes AMX tile instructions but
  never asks the kernel for permission to use them. It only works when oneDNN asked first (during
  a multi-token GEMM, i.e. a prefill). A decode engine whose first step runs on transferred KV
  reaches the AMX kernel first and dies with SIGILL. We request XTILEDATA permission up front.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_amx_requested: bool | None = None


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission for this process. Idempotent; True on success."""
    global _amx_requested
    if _amx_requested is not None:
        return _amx_requested
    _amx_requested = False
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not cpu_has_amx():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        logger.warning(
            "AMX permission request failed (errno %d); decode on transferred KV may crash",
            ctypes.get_errno(),
        )
        return False
    _amx_requested = True
    logger.debug("AMX tile-data permission granted to pid %d", os.getpid())
    return True


def register() -> None:
    """Entry point named in pyproject.toml (`vllm.general_plugins`)."""
    from pdcluster.logs import setup_logging

    setup_logging()  # our connector logs from vLLM's engine processes too
    request_amx_permission()
