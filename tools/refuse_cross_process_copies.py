"""Run a command on a machine made to refuse copies between processes (process_vm_readv and
process_vm_writev fail with EPERM), as a container without CAP_SYS_PTRACE does (Docker's default
seccomp profile): the shm backend's direct path is then refused and it uses its ring. The tests
skip or expect that where they run so (tests/support/cma.py); this checks they do:

    .venv/bin/python tools/refuse_cross_process_copies.py .venv/bin/python -m pytest tests/unit/test_direct_shm.py

A seccomp filter, inherited by every process the command starts; x86-64 system calls only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
AUDIT_ARCH_X86_64 = 0xC000003E
PROCESS_VM_READV, PROCESS_VM_WRITEV = 310, 311  # x86-64 system call numbers
LOAD, JUMP_IF_EQUAL, RETURN = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
ALLOW, FAIL_WITH = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse() -> None:
    """From now on this process and every one it starts get EPERM from both system calls."""

    def op(code: int, true: int, false: int, k: int) -> bytes:
        return struct.pack("HBBI", code, true, false, k)

    program = b"".join(
        [
            op(LOAD, 0, 0, 4),  # seccomp_data.arch
            op(JUMP_IF_EQUAL, 0, 3, AUDIT_ARCH_X86_64),  # another ABI: allowed
            op(LOAD, 0, 0, 0),  # seccomp_data.nr
            op(JUMP_IF_EQUAL, 2, 0, PROCESS_VM_READV),
            op(JUMP_IF_EQUAL, 1, 0, PROCESS_VM_WRITEV),
            op(RETURN, 0, 0, ALLOW),
            op(RETURN, 0, 0, FAIL_WITH | errno.EPERM),
        ]
    )
    instructions = ctypes.create_string_buffer(program, len(program))
    filter_ = _Program(len(program) // 8, ctypes.addressof(instructions))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(
        PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(filter_), 0, 0
    ):
        raise OSError(ctypes.get_errno(), f"installing the seccomp filter: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: refuse_cross_process_copies.py COMMAND [ARG ...]")
    refuse()
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
