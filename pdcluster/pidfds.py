"""Whether a process runs: held by a pidfd (readable once the process exited), or by its pid or
process group (signal 0); and which pid namespace a pid means something in.

What a process leaves in a shared directory (its KV secret file, shm segments, its engine's
private temp directories, the record of its engine's vLLM queues) is named after its maker,
`<prefix><pid namespace>.<pid>.<start>-<rest>` (`maker_tag`): one killed (SIGKILL, the OOM
killer) cannot remove it, and the next process of the same pid namespace that makes such things
removes what it finds of makers that are gone (`remove_left_behind`). Several pid namespaces may
share a directory (the test hosts share /tmp and /dev/shm; two machines may share a TMPDIR), and
a pid means nothing outside its own: what other namespaces made is left alone.

poll(), not select(): select() refuses descriptors past 1024 (ValueError), and a process holding
many descriptors (connections to its ports, an engine's sockets) gets such numbers."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import select
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdcluster.errors import ConfigError

logger = logging.getLogger(__name__)


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
    """This process's pid namespace, as 12 hex digits: a hash of its inode and the kernel's boot id
    (two machines sharing a TMPDIR have the same inode for their initial namespaces; short, as
    Unix socket paths inside directories named after it must stay under 108 bytes); "" where
    /proc does not say."""
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return namespace_id(boot, inode)


def namespace_id(boot_id: str, inode: int) -> str:
    """The id of pid namespace `inode` of the kernel booted as `boot_id` (pid_namespace)."""
    return hashlib.blake2b(f"{boot_id}/{inode}".encode(), digest_size=6).hexdigest()


def start_ticks(pid: int) -> int | None:
    """When process `pid` of this pid namespace started, in clock ticks since boot
    (/proc/<pid>/stat); None once it ended, or where /proc shows another pid namespace's."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None  # /proc mounted for another pid namespace: its <pid> is another process
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[19])  # field 22, starttime (those after the command's ")" begin at 3)
    except (OSError, ValueError, IndexError):
        return None


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
START_MARK_DIGITS = 4
START_MARK = f"[0-9a-z]{{1,{START_MARK_DIGITS}}}"  # a start mark in a name (start_mark), as a regex
_START_MARK = re.compile(f"(?:{START_MARK})?")  # empty: a name from before names carried it


def start_mark(pid: int) -> str | None:
    """Process `pid`'s start, short: its start ticks modulo 36**4, in base 36 (4 characters: a
    name must leave room for the Unix sockets made in a directory named so). A later process of
    the same pid that started a multiple of 36**4 ticks later (4.7 h at 100 Hz) has the same
    mark: its maker's file is then kept, as a sweep by the pid alone did."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    ticks %= len(_DIGITS) ** START_MARK_DIGITS
    mark = ""
    while True:
        ticks, digit = divmod(ticks, len(_DIGITS))
        mark = _DIGITS[digit] + mark
        if not ticks:
            return mark


def maker_tag(pid: int | None = None) -> str:
    """`<pid namespace>.<pid>.<start>` of process `pid` (default: this one), for the names of what
    it leaves in a shared directory. The start (start_mark) tells it from a later process given
    the same pid: a pid namespace made afresh (a container's, a test host's) hands out the same
    pids run after run, and a sweep by the pid alone kept what the last run left for good. "0"
    for the namespace where /proc does not say (never swept); no start where /proc does not
    show it (the pid alone says)."""
    pid = os.getpid() if pid is None else pid
    mark = start_mark(pid)
    return f"{pid_namespace() or 0}.{pid}" + ("" if mark is None else f".{mark}")


def remove_left_behind(
    directory: str | Path,
    prefix: str,
    what: str,
    valid: Callable[[str], bool] | None = None,
    release: Callable[[Path], object] | None = None,
) -> None:
    """Remove this user's files and directories in `directory` named `<prefix><maker_tag>-...`
    whose maker ran in this pid namespace and no longer runs (and whose name `valid` accepts);
    `release`, given each one first, removes what it names elsewhere."""
    namespace = pid_namespace()
    if not namespace:
        return  # where /proc does not say, a pid is not known to be this namespace's
    for path in Path(directory).glob(f"{prefix}{namespace}.*"):
        pid, _, mark = path.name[len(prefix) + len(namespace) + 1 :].partition("-")[0].partition(".")
        try:
            if not pid.isdigit() or not _START_MARK.fullmatch(mark):
                continue
            if valid is not None and not valid(path.name):
                continue
            if path.lstat().st_uid != os.getuid() or _maker_runs(int(pid), mark or None):
                continue
            if release is not None:
                release(path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile (its own process, or another one's sweep)
        except OSError as exc:  # a sweep never fails what runs it
            logger.warning("could not remove %s %s left by a process that is gone: %s", what, path.name, exc)
            continue
        logger.info("removed %s %s left by a process that is gone", what, path.name)


def _maker_runs(pid: int, mark: str | None) -> bool:
    """Whether the process that made a file named after it (pid, start mark) still runs: a
    process of that pid runs and, where the name has the maker's start, started then."""
    if not running(pid):
        return False
    if mark is None:
        return True  # a name from before names carried the start: the pid alone says
    now = start_mark(pid)
    return now is None or now == mark  # None: it ended meanwhile, or /proc cannot say


UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its NUL)


def private_dir(prefix: str, what: str, room: int) -> str:
    """A new directory of this process's own (mode 0700) in the temp directory, named after it;
    those of makers that are gone (killed before they could remove theirs) removed first.
    `room`: the longest name of a Unix socket to be made in it. Where the temp directory's path
    is too long for that, the directory gets a short name (`pdc-<random>`: not swept), or, if even
    that is too long, the error says so (a socket's bind would fail with less)."""
    tmp = tempfile.gettempdir()
    remove_left_behind(tmp, prefix, what)
    for name in (f"{prefix}{maker_tag()}-", "pdc-"):
        path = tempfile.mkdtemp(prefix=name)
        if len(path.encode()) + 1 + room <= UNIX_PATH_MAX:
            return path
        os.rmdir(path)
    raise ConfigError(
        f"the temp directory {tmp} is too long for the {what}'s Unix sockets (paths of at most "
        f"{UNIX_PATH_MAX} bytes): set a shorter TMPDIR"
    )
