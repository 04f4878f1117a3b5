"""Cross-memory attach: copy blocks between our memory and another process's (Linux
`process_vm_readv` / `process_vm_writev`, one copy, no intermediate buffer).

The shm backend's direct variant uses it when both caches are in host memory. The kernel allows
it only where the caller may ptrace the target (same user and Yama ptrace_scope 0, or
CAP_SYS_PTRACE); otherwise it fails with EPERM and the caller falls back to the shared ring.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence

import numpy as np

from pdcluster.errors import KVTransferError

IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
_writev = getattr(_libc, "process_vm_writev", None)
for _fn in (_readv, _writev):
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]

# errnos meaning "this machine does not let us read the peer" (not a bug in the request)
REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH)


def available() -> bool:
    return _readv is not None and _writev is not None


def block_iovecs(bases: Sequence[int], row_bytes: Sequence[int], block_ids: Sequence[int]) -> np.ndarray:
    """struct iovec[] (as uint64 pairs) for `block_ids` of every layer, layer by layer."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    parts = []
    for base, row in zip(bases, row_bytes):
        iov = np.empty((len(ids), 2), dtype=np.uint64)
        iov[:, 0] = np.uint64(base) + ids * np.uint64(row)
        iov[:, 1] = row
        parts.append(iov)
    return np.ascontiguousarray(np.concatenate(parts))


def copy(pid: int, local: np.ndarray, remote: np.ndarray, *, write: bool = False) -> int:
    """Copy each remote iovec of process `pid` into the local iovec at the same index (or, with
    `write`, each local one into the remote one).

    Raises OSError (errno in REFUSED when the OS forbids it) or KVTransferError on a short copy.
    """
    fn, what = (_writev, "process_vm_writev") if write else (_readv, "process_vm_readv")
    if fn is None:
        raise OSError(errno.ENOSYS, f"{what} is not available")
    if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
        raise KVTransferError("local and remote block lists differ in shape or sizes")
    total = 0
    for start in range(0, len(local), IOV_MAX):
        count = min(IOV_MAX, len(local) - start)
        want = int(local[start : start + count, 1].sum())
        got = fn(
            pid,
            local.ctypes.data + start * 16,
            count,
            remote.ctypes.data + start * 16,
            count,
            0,
        )
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what} with pid {pid}: {os.strerror(code)}")
        if got != want:
            raise KVTransferError(f"{what} with pid {pid} copied {got} of {want} bytes")
        total += got
    return total
