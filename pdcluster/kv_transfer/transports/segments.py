"""POSIX shared-memory segments for the shm backend's ring (files under /dev/shm, mode 0600).

A producer creates a segment per ring (O_EXCL: it never adopts a file someone else made) and
unlinks it when its server stops; a consumer maps a segment it was told of, read-only. Names are
random and only ever sent in reply to an authenticated call. They name their producer's pid
namespace, pid and start (`pdcluster-kv-<pid namespace>.<pid>.<start>-<random>`, pidfds.maker_tag):
a producer that was killed leaves its segments behind (tmpfs pages), and the next one started in
that pid namespace removes them (`remove_orphans`; several namespaces may share /dev/shm, as test
hosts do). A segment's pages are allocated when it is made (posix_fallocate): a full /dev/shm is
a clear error then, not a SIGBUS at the first write into a page tmpfs cannot back.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
from pathlib import Path

from pdcluster.errors import KVTransferError
from pdcluster.pidfds import START_MARK, maker_tag, remove_left_behind

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdcluster-kv-"
# (a producer from before names carried the namespace, or its start: no such part)
_NAME = re.compile(rf"pdcluster-kv-(?:[0-9a-f]+\.)?[0-9]+(?:\.{START_MARK})?-[0-9a-f]{{16}}")
SLOTS = 4  # chunks in flight per pull (4 MiB each by default)
_PAGE = mmap.PAGESIZE


class Segment:
    """A mapped POSIX shared-memory segment (a file under /dev/shm)."""

    def __init__(self, name: str, size: int, *, create: bool):
        if not _NAME.fullmatch(name):
            raise KVTransferError(f"refusing shared-memory segment name {name!r}")
        self.name = name
        self.size = size
        self.path = SHM_DIR / name
        if create:
            # O_EXCL: never adopt a file someone else made; 0600: only this user may map it.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = os.open(self.path, os.O_RDONLY)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise KVTransferError(
                        f"cannot allocate {size} bytes of shared memory in {SHM_DIR} ({exc.strerror}; "
                        f"{free_bytes()} free): enlarge it (e.g. docker --shm-size) or use kv_transfer.backend grpc"
                    ) from None
            elif os.fstat(fd).st_size < size:
                raise KVTransferError(
                    f"shared-memory segment {name} has {os.fstat(fd).st_size} bytes, the producer announced {size}"
                )
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            logger.warning("shared-memory segment %s still has views; left mapped", self.name)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return


def free_bytes() -> int:
    """What /dev/shm can still hold."""
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def ring_bytes(slot_bytes: int) -> int:
    return SLOTS * (-(-slot_bytes // _PAGE) * _PAGE)


class Ring:
    """A producer's segment cut into SLOTS equal slots."""

    def __init__(self, slot_bytes: int):
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        name = f"{owner_prefix(os.getpid())}{secrets.token_hex(8)}"
        self.segment = Segment(name, SLOTS * self.slot_bytes, create=True)

    def offset(self, index: int) -> int:
        return (index % SLOTS) * self.slot_bytes


def owner_prefix(pid: int) -> str:
    """The start of the names of the segments process `pid` (of this pid namespace) makes."""
    return f"{SEGMENT_PREFIX}{maker_tag(pid)}-"


def remove_orphans() -> None:
    """Remove this user's segments made in this pid namespace by a process that no longer runs
    (killed before it could unlink them)."""
    remove_left_behind(SHM_DIR, SEGMENT_PREFIX, "shared-memory segment", valid=_NAME.fullmatch)
