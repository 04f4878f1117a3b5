"""Whether a process runs: held by a pidfd (readable once the process exited), or by its pid or
process group (signal 0); and which pid namespace a pid means something in.

What a process leaves in a shared directory (its KV secret file, shm segments, its engine's
private temp directories, the record of its engine's vLLM queues) is named after its maker, `<prefix><pid namespace>.<pid>-<rest>`
(`maker_tag`): one killed (SIGKILL, the OOM killer) cannot remove it, and the next process of the
same pid namespace that makes such things removes what it finds of makers that are gone
(`remove_left_behind`). Several pid namespaces may share a directory (the test hosts share /tmp
and /dev/shm; two machines may share a TMPDIR), and a pid means nothing outside its own: what
other namespaces made is left alone.

poll(), not select(): select() refuses descriptors past 1024 (ValueError), and a process holding
many descriptors (connections to its ports, an engine's sockets) gets such numbers."""

from __future__ import annotations

import hashlib
import logging
import os
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


def maker_tag() -> str:
    """`<pid namespace>.<pid>` of this process, for the names of what it leaves in a shared
    directory ("0" for the namespace where /proc does not say: never swept)."""
    return f"{pid_namespace() or 0}.{os.getpid()}"


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
        pid = path.name[len(prefix) + len(namespace) + 1 :].partition("-")[0]
        try:
            if not pid.isdigit() or (valid is not None and not valid(path.name)):
                continue
            if path.lstat().st_uid != os.getuid() or running(int(pid)):
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
