"""What a process's memory is on, read from /proc: which mappings were hinted for 2 MiB pages
(MADV_HUGEPAGE, the `hg` VmFlag) and how much of them the kernel backed with huge pages.

The hint is ours to give; the pages are the kernel's: MADV_COLLAPSE is refused (ENOMEM, EAGAIN)
when it has no free 2 MiB blocks at that moment, and kernels before 6.1 have no MADV_COLLAPSE at
all (EINVAL). So tests assert the hint and read the backing as a diagnostic."""

from __future__ import annotations

from pathlib import Path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Does this kernel have transparent huge pages (MADV_HUGEPAGE is refused without them)?"""
    return THP.exists()


def hinted_kib(pid: int | str = "self", within: tuple[int, int] | None = None) -> tuple[int, int]:
    """(KiB of the mappings hinted MADV_HUGEPAGE, KiB of them on huge pages) in process `pid`,
    only mappings inside the address range `within` if given."""
    hinted = huge = 0
    start = end = size = anon_huge = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
        elif fields[0] == "Size:":
            size = int(fields[1])
        elif fields[0] == "AnonHugePages:":
            anon_huge = int(fields[1])
        elif fields[0] == "VmFlags:" and "hg" in fields[1:]:
            if within is None or (within[0] <= start and end <= within[1]):
                hinted, huge = hinted + size, huge + anon_huge
    return hinted, huge
