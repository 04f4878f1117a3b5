"""vLLM's shared-memory queues of an engine: removed by its host's stop, or if the host was
killed, by the next host.

vLLM's engine core and its worker processes talk through segments of Python's
`multiprocessing.shared_memory` (`/dev/shm/psm_*`; 400 MB for one CPU worker). The process that
made one unlinks it when the object is finalized, which vLLM's shutdown often ends the process
before; otherwise only multiprocessing's resource tracker does, once every process registered
with it has ended. That tracker is a child of the engine's host, and Ray ends an actor by
SIGKILLing its children and then its process group: host, engine processes and tracker at once.
So a replica the controller replaced after its engine died (a worker killed by the OOM killer, an
engine core that crashed), and often one `down` stopped cleanly, left its queues in /dev/shm,
their pages held until the machine restarted. No process of the actor's can outlive it to remove
them, so they are removed the way pdcluster removes what any killed process leaves (pidfds.py):
  - once its engine runs, a host records the segments its engine's processes map, in a file
    named after the host (`pdcluster-vllm-shm-<pid namespace>.<pid>.<start>-*.json`, temp
    directory);
  - its stop, once the engine is shut down, unlinks what is left of them and the record;
  - a host killed leaves the record, and the next engine host started in the same pid namespace
    (the controller's replacement, at once) unlinks each recorded segment that is still the one
    recorded (same inode), then the record.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from pdcluster.pidfds import maker_tag, remove_left_behind

logger = logging.getLogger(__name__)

# where multiprocessing.shared_memory puts a segment it names (`/psm_<random>` through shm_open)
SEGMENT_PREFIX = "/dev/shm/psm_"
RECORD_PREFIX = "pdcluster-vllm-shm-"
RECORD_SUFFIX = ".json"


def mapped_segments(pid: int | str) -> dict[str, int]:
    """The multiprocessing shared-memory segments process `pid` maps that are still linked (a
    name in /dev/shm): path -> inode. Empty once the process ended."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:  # it ended (or is not ours to read)
        return {}
    found: dict[str, int] = {}
    for fields in (line.split(maxsplit=5) for line in lines):
        if len(fields) == 6 and fields[5].startswith(SEGMENT_PREFIX) and not fields[5].endswith(" (deleted)"):
            found[fields[5]] = int(fields[4])
    return found


def record_segments() -> Path | None:
    """In an engine's host, once its engine runs: the record of the segments the processes below
    it map. None when none maps one (a single-process engine: no queue between processes)."""
    import psutil

    segments: dict[str, int] = {}
    for process in psutil.Process().children(recursive=True):
        segments.update(mapped_segments(process.pid))
    if not segments:
        return None
    fd, path = tempfile.mkstemp(prefix=f"{RECORD_PREFIX}{maker_tag()}-", suffix=RECORD_SUFFIX)  # mode 0600
    with os.fdopen(fd, "w") as record:
        json.dump(segments, record)
    return Path(path)


def release(record: Path) -> list[str]:
    """Unlink each segment of `record` still the one recorded (same inode); the record stays (its
    remover's to remove). Returns the paths unlinked."""
    try:
        segments = json.loads(record.read_text())
    except (OSError, ValueError) as exc:  # a host killed while it wrote the record
        logger.warning("unreadable record of vLLM's shared memory %s: %s", record.name, exc)
        return []
    removed = []
    for path, inode in segments.items():
        if not path.startswith(SEGMENT_PREFIX) or "/" in path[len(SEGMENT_PREFIX) :]:
            logger.warning("%s names %r, not a multiprocessing segment: left alone", record.name, path)
            continue
        try:
            if os.stat(path).st_ino != inode:
                continue  # a new segment of the same name: not this engine's
            os.unlink(path)
        except FileNotFoundError:
            continue  # its maker unlinked it (a clean shutdown)
        except OSError as exc:
            logger.warning("could not remove %s (vLLM's shared memory, %s): %s", path, record.name, exc)
            continue
        removed.append(path)
    if removed:
        logger.info("removed vLLM's shared memory that engine processes ended without removing: %s", ", ".join(removed))
    return removed


def remove_left_segments() -> None:
    """The segments of hosts in this pid namespace that no longer run, and their records."""
    remove_left_behind(
        tempfile.gettempdir(),
        RECORD_PREFIX,
        "record of vLLM's shared memory",
        valid=lambda name: name.endswith(RECORD_SUFFIX),
        release=release,
    )
