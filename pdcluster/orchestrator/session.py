"""Where a running cluster lives: its Ray cluster, the local head we started, its endpoint.

`pdcluster up` records a session file per cluster name under $PDCLUSTER_HOME (default
~/.pdcluster) so that `status`, `scale` and `down` find the cluster again. When no Ray address is
configured, `up` starts a local Ray head as a child process group (`ray start --head --block`),
waits for its own "started" message, and `down` stops exactly that process group (never other
Ray clusters on the machine).

That head takes only callers holding its token (Ray's token authentication, RAY_AUTH_MODE=token):
a random one per cluster, in a private file beside the record (`<name>.ray-token`, mode 0600),
named to Ray by path (RAY_AUTH_TOKEN_PATH) in the head's environment, which Ray's workers inherit,
and in the CLI's before it joins. Set explicitly, it also keeps Ray's own default out: `ray start`
turns token mode on when ~/.ray/auth_token exists (any earlier plain `ray.init()` writes one),
while a joining `ray.init(address=...)` does not, and the CLI was refused by its own head. A
cluster `up` joins (ray.address) keeps the operator's Ray settings.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path

from pdcluster.errors import ConfigError, PDClusterError
from pdcluster.pidfds import group_running

HEAD_START_TIMEOUT_S = 120
FOREGROUND_STOP_TIMEOUT_S = 300  # a foreground `up` stops its engines gracefully first
STALE_TRIES = 3  # connections to a joined cluster's address that time out before its record goes

logger = logging.getLogger(__name__)


def state_home() -> Path:
    return Path(os.environ.get("PDCLUSTER_HOME", "~/.pdcluster")).expanduser()


def controller_name(cluster: str) -> str:
    """The controller actor's name (detached, in the cluster's namespace)."""
    return f"{cluster}-controller"


def host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a Ray address: "host:port", "[v6 address]:port", "ray://host:port"; None
    where it names no port ("auto")."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class Session:
    name: str
    ray_address: str
    namespace: str
    endpoint: str | None = None
    head_pid: int | None = None  # process group of the Ray head we started (None: joined)
    config_path: str | None = None
    foreground_pid: int | None = None  # `up --foreground` serving it: `down` asks that one to stop
    ray_token_path: str | None = None  # the token of the head we started (None: joined)

    def is_stale(self) -> bool:
        """Its Ray is gone: the head we started has exited, or the joined cluster's address
        refuses connections (or times out, STALE_TRIES times in a row). An address that names no
        host and port ("auto"), or a host name that does not resolve now, proves nothing: the
        record stays (removing it would leave a live cluster's actors with no record to find)."""
        if self.head_pid is not None:
            return not group_running(self.head_pid)
        target = host_and_port(self.ray_address)
        if target is None:
            return False  # "auto" and the like: Ray finds it; not ours to judge
        for _ in range(STALE_TRIES):
            try:
                socket.create_connection(target, timeout=2).close()
            except socket.gaierror:
                return False
            except ConnectionRefusedError:
                return True  # the host answers, nothing listens there
            except OSError:
                continue  # timed out or unreachable: a blip, or a host that is gone
            return False
        return True

    @property
    def path(self) -> Path:
        return state_home() / f"{self.name}.json"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.ray_token_path:
            Path(self.ray_token_path).unlink(missing_ok=True)

    @classmethod
    def load(cls, name: str | None, notice: Callable[[str], None] | None = None) -> Session:
        """The record of cluster `name` (the only one up, for None). With `notice`, records whose
        Ray is gone are removed first, and `notice` gets a line for each."""
        home = state_home()
        if name is None:
            found = [cls._read(p) for p in sorted(home.glob("*.json"))] if home.exists() else []
            found = [s for s in found if not (notice and s.drop_if_stale(notice))]
            if not found:
                raise ConfigError("no running cluster (pdcluster up FILE starts one)")
            if len(found) > 1:
                names = ", ".join(s.name for s in found)
                raise ConfigError(f"several clusters are up ({names}): choose one with --name")
            return found[0]
        path = home / f"{name}.json"
        if not path.exists():
            raise ConfigError(f"no running cluster named {name!r}")
        session = cls._read(path)
        if notice and session.drop_if_stale(notice):
            raise ConfigError(f"no running cluster named {name!r}")
        return session

    @classmethod
    def _read(cls, path: Path) -> Session:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cluster record {path} is unreadable ({exc}); remove it") from None

    def stop_foreground(self, notice: Callable[[str], None]) -> bool:
        """Ask the `up --foreground` serving the cluster to stop it (SIGINT: its own Ctrl-C path,
        which exits 0; Ray's driver answers SIGTERM itself, by exiting at once) and wait until it
        did; False when there is no such process."""
        import psutil

        try:
            process = psutil.Process(self.foreground_pid)
            if "pdcluster" not in " ".join(process.cmdline()):
                return False  # the pid was reused by something else
            process.send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            return False
        # Done once its teardown removed the record (its parent may not have reaped it yet: a
        # zombie counts as gone).
        deadline = time.monotonic() + FOREGROUND_STOP_TIMEOUT_S
        while self.path.exists():
            try:
                gone = process.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone or time.monotonic() > deadline:
                if not gone:
                    notice(f"the foreground `up` (pid {self.foreground_pid}) did not stop in time; stopping it here")
                return not self.path.exists()
            time.sleep(0.1)  # poll interval: the foreground stops its engines first
        return True

    def drop_if_stale(self, notice: Callable[[str], None]) -> bool:
        if not self.is_stale():
            return False
        self.remove()
        notice(f"removed the record of cluster {self.name!r}: its Ray ({self.ray_address}) is gone")
        return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


RAY_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def write_ray_token(name: str) -> str:
    """A new random token for the local head of cluster `name`, in a file only its owner reads."""
    path = state_home() / f"{name}.ray-token"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a killed `up`'s; its head is gone (the record says so first)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return str(path)


def set_ray_auth(env: MutableMapping[str, str], token_path: str | None) -> None:
    """Set Ray's authentication variables in `env` (an environment, os.environ included) for the
    local head and those who join it: its token's file, or (None: a head a test starts bare) no
    authentication, stated rather than left to Ray. Any others go (a token in RAY_AUTH_TOKEN
    would win over the file)."""
    for name in RAY_AUTH_VARIABLES:
        env.pop(name, None)
    if token_path is None:
        env["RAY_AUTH_MODE"] = "disabled"
    else:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)


# Ray runs worker processes at nice 15 by default; our workers *are* the service (router,
# engines), so they run at normal priority, like Ray's own job supervisor arranges for jobs.
WORKERS_AT_NORMAL_PRIORITY = {"RAY_worker_niceness": "0"}


def ray_command() -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts"]


HEAD_START_TRIES = 3  # GCS ports tried before `up` gives up on a head that cannot bind its port


def start_local_head(
    num_cpus: int | None, log_path: Path, port: int = 0, token_path: str | None = None
) -> tuple[str, int]:
    """Start `ray start --head --block` in its own process group; return (address, pid). It
    takes callers holding the token in `token_path` (None: any caller).

    The GCS port (`port`, or a free one) is chosen here and bound by Ray seconds later; a port
    another process took meanwhile (a source port of some connection) makes the head exit, and
    it is started again on another free port."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    for _ in range(HEAD_START_TRIES):
        port = port or free_port()
        offset = log.seek(0, os.SEEK_END)
        proc, failure = _start_head(port, num_cpus, log, token_path)
        if failure is None:
            # Keep draining its stdout into the log so the head never blocks on a full pipe.
            _drain_in_background(proc, log)
            return f"127.0.0.1:{port}", proc.pid
        log.flush()
        said = log_path.read_bytes()[offset:].decode(errors="replace")
        if proc.returncode is None or not (port_in_use(port) or re.search(rf"\b{port}\b", said)):
            break  # not its port: starting it again would fail the same way
        logger.warning("the local Ray head could not bind port %d (taken meanwhile); trying another", port)
        port = 0
    log.close()
    lines = [line.strip() for line in (said or failure).splitlines() if line.strip()] or ["no output"]
    last = next((line for line in reversed(lines) if "Error:" in line), lines[-1])  # Python's own error line
    raise PDClusterError(f"local Ray head did not start (see {log_path}): {last[:300]}")


def _start_head(port: int, num_cpus: int | None, log, token_path: str | None) -> tuple[subprocess.Popen, str | None]:
    """One `ray start --head`: the process, and None once Ray says it started, else what it
    printed before it exited (returncode set) or timed out (returncode None; stopped)."""
    cmd = [
        *ray_command(),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    env = dict(os.environ, **WORKERS_AT_NORMAL_PRIORITY)
    set_ray_auth(env, token_path)
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    seen = b""
    try:
        while b"Ray runtime started" not in seen:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process_group(proc.pid)
                return proc, seen.decode(errors="replace")
            if sel.select(timeout=1.0):
                chunk = os.read(proc.stdout.fileno(), 65536)
                seen += chunk
                log.write(chunk)
                log.flush()  # in order with what the head writes to the log itself (its stderr)
    except BaseException:
        # Ctrl-C while it starts: its own session got no signal, and no record names it yet
        stop_process_group(proc.pid)
        raise
    return proc, None


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _drain_in_background(proc: subprocess.Popen, log) -> None:
    import threading

    def pump() -> None:
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
            log.write(chunk)
            log.flush()

    threading.Thread(target=pump, daemon=True, name="ray-head-log").start()


def stop_process_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM the group, SIGKILL whatever is left after timeout_s.

    `ray start --block` stops its processes one by one on SIGTERM (~30 s here); by the time we
    get here the engines have been shut down gracefully, so the rest may be killed.
    """
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pgid)
            if not group_running(pgid):
                return
            time.sleep(0.1)  # polling a process group's exit (no event exists for it)


def _reap(pid: int) -> None:
    """Collect the head's exit status if it is our child (else it would linger as a zombie)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return
