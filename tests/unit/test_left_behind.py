"""What a killed process leaves in a shared directory (pidfds.remove_left_behind): the KV secret's
file on each node (engine/actor.py: private, removed once the engine runs, which an actor killed in
the middle of its engine's start never reached) and an engine's private temp directories (vLLM's
IPC sockets, the KV events socket, the KV failure inbox: removed when the engine stops, which a
killed one never does). The next process of that pid namespace to make one removes them; those of
makers still running, or of other pid namespaces, are left alone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdcluster.engine.actor import write_secret_file
from pdcluster.pidfds import maker_tag, namespace_id, pid_namespace, start_mark, start_ticks

WRITER = (
    "import sys, time\n"
    "from pdcluster.engine.actor import write_secret_file\n"
    "print(write_secret_file(sys.argv[1], 'the-secret', sys.argv[2]), flush=True)\n"
    "time.sleep(600)\n"
)


def writer(engine_id: str, directory) -> tuple[subprocess.Popen, str]:
    """An actor stand-in: a process that wrote its engine's secret file and is still starting."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, engine_id, str(directory)], stdout=subprocess.PIPE, text=True
    )
    return process, process.stdout.readline().strip()


def test_a_killed_actors_secret_file_is_removed_by_the_next_engine_started_on_the_node(tmp_path):
    killed, orphan = writer("c-decode-0", tmp_path)
    starting, live = writer("c-prefill-0", tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)  # ray.kill of an actor in the middle of a start
        killed.wait(timeout=30)
        assert os.path.exists(orphan)
        path = write_secret_file("c-decode-1", "the-secret", str(tmp_path))
        assert not os.path.exists(orphan)
        assert os.path.exists(live)  # its writer still runs: its engine may yet read it
        with open(path) as f:
            assert f.read() == "the-secret"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.path.basename(path).startswith(f"pdcluster-secret-{maker_tag()}-c-decode-1.")
        assert maker_tag() == f"{pid_namespace()}.{os.getpid()}.{start_mark(os.getpid())}"
    finally:
        starting.kill()
        starting.wait(timeout=30)
        killed.stdout.close()
        starting.stdout.close()


def test_a_secret_file_of_another_pid_namespace_is_left_alone(tmp_path):
    """Hosts in pid namespaces of their own may share /tmp (the multi-node test hosts do), and
    machines may share a TMPDIR: a pid that runs no process here may run the writer there, still
    starting its engine. Only files written in this pid namespace of this kernel are swept."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)  # a pid that runs nothing in this namespace
    namespace = pid_namespace()
    boot, inode = Path("/proc/sys/kernel/random/boot_id").read_text().strip(), os.stat("/proc/self/ns/pid").st_ino
    assert namespace == namespace_id(boot, inode)
    elsewhere = [  # another pid namespace of this kernel; the same one of another machine's
        tmp_path / f"pdcluster-secret-{namespace_id(boot, inode + 1)}.{gone.pid}-c-decode-0.abc123.secret",
        tmp_path / f"pdcluster-secret-{namespace_id('0' * 32, inode)}.{gone.pid}-c-decode-1.abc124.secret",
    ]
    here = tmp_path / f"pdcluster-secret-{namespace}.{gone.pid}-c-decode-2.def456.secret"
    for path in (*elsewhere, here):
        path.write_text("the-secret")
    write_secret_file("c-prefill-0", "the-secret", str(tmp_path))
    assert all(path.exists() for path in elsewhere) and not here.exists()


def test_a_file_whose_makers_pid_now_runs_a_later_process_is_removed(tmp_path):
    """A pid namespace made afresh (a container's, each multi-node test host's) hands out the same
    pids run after run: the sweep kept what the last run's killed process left as long as its pid
    ran anything, which in such a namespace is the next run's process of that role, itself
    sweeping. The name carries the maker's start: a process of that pid that started at another
    time is not its maker. Names without the start (made before) still go by the pid alone."""
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        tag = maker_tag(later.pid)
        started = start_ticks(later.pid)
        mark = start_mark(later.pid)
        assert started is not None and tag == f"{pid_namespace()}.{later.pid}.{mark}"
        assert int(mark, 36) == started % 36**4
        another = "zzzz" if mark != "zzzz" else "0"  # the start of the pid's last process
        earlier = tmp_path / f"pdcluster-secret-{pid_namespace()}.{later.pid}.{another}-c-decode-0.a1.secret"
        its_own = tmp_path / f"pdcluster-secret-{tag}-c-decode-1.a2.secret"
        unstarted = tmp_path / f"pdcluster-secret-{pid_namespace()}.{later.pid}-c-decode-2.a3.secret"
        for path in (earlier, its_own, unstarted):
            path.write_text("the-secret")
        write_secret_file("c-prefill-0", "the-secret", str(tmp_path))
        assert not earlier.exists() and its_own.exists() and unstarted.exists()
    finally:
        later.kill()
        later.wait(timeout=30)


MAKERS = (  # two engines' three private directories each, made as the engine host makes them
    "import os, sys\n"
    "from pdcluster.engine.host import private_ipc_dir\n"
    "from pdcluster.engine.kv_events import KVEventRelay\n"
    "from pdcluster.kv_transfer.failures import FailureInbox\n"
    "for _ in range(2):\n"  # a process per engine, forked: the modules are imported once
    "    if os.fork() == 0:\n"
    "        os.environ.pop('VLLM_RPC_BASE_PATH', None)\n"
    "        made = [private_ipc_dir(), KVEventRelay().directory, os.path.dirname(FailureInbox().path)]\n"
    "        print(os.getpid(), *made, flush=True); sys.stdin.read(); os._exit(0)\n"
    "while True:\n"  # reaped, a maker's pid runs nothing: what the next engine's sweep looks for
    "    try:\n"
    "        pid, _ = os.wait()\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "    print('ended', pid, flush=True)\n"
)


def test_a_killed_engines_private_directories_are_removed_by_the_next_engine(monkeypatch):
    """An engine host killed (its actor killed: ray.kill, a lost node, the OOM killer) never
    removed its three private directories from the temp directory. The next engine's own removes
    them; a running engine's are left alone."""
    from pdcluster.engine.host import RPC_BASE_ENV, private_ipc_dir
    from pdcluster.engine.kv_events import KVEventRelay
    from pdcluster.kv_transfer.failures import FailureInbox

    tmp_path = Path(tempfile.mkdtemp(prefix="lb-", dir="/tmp"))  # short: sockets are made inside
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again (here and in the children)
    monkeypatch.setenv(RPC_BASE_ENV, "")  # private_ipc_dir sets it: restored after the test
    monkeypatch.delenv(RPC_BASE_ENV)
    makers = subprocess.Popen(
        [sys.executable, "-c", MAKERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    running = None
    try:
        made = [makers.stdout.readline().split() for _ in range(2)]  # pid, then its directories
        (killed, *left), (running, *kept) = made
        assert len(left) == 3 and all(os.path.dirname(path) == str(tmp_path) for path in left), made
        os.kill(int(killed), signal.SIGKILL)
        assert makers.stdout.readline().split() == ["ended", killed]
        assert all(os.path.isdir(path) for path in left)
        inbox, relay = FailureInbox(), KVEventRelay()
        try:
            made = private_ipc_dir()
            assert not any(os.path.exists(path) for path in left), left
            assert all(os.path.isdir(path) for path in kept)
            assert os.path.basename(made).startswith(f"pdcluster-vllm-ipc-{maker_tag()}-")
        finally:
            inbox.close()
            relay.stop()
    finally:
        makers.stdin.close()  # the running maker ends at its input's end, then their parent
        try:
            makers.wait(timeout=30)
        finally:
            for pid in (running, makers.pid):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            makers.stdout.close()
        shutil.rmtree(tmp_path)


def test_a_long_temp_directory_still_gets_working_sockets_or_a_clear_error(monkeypatch):
    """Unix socket paths hold at most 107 bytes. Under a long TMPDIR (a CI runner's work
    directory) the named private directories left no room for the sockets made in them: the KV
    failure inbox failed to bind ("AF_UNIX path too long") and the engine with it. Such a
    directory gets a short name instead (not swept); vLLM's IPC sockets, with 36-byte names, go in
    TMPDIR itself where even that leaves no room (stock vLLM's place); a TMPDIR too long for any
    of it is refused naming TMPDIR."""
    from pdcluster.engine.host import RPC_BASE_ENV, private_ipc_dir
    from pdcluster.errors import ConfigError
    from pdcluster.kv_transfer.failures import FailureInbox

    base = Path(tempfile.mkdtemp(prefix="lb-", dir="/tmp"))
    monkeypatch.setenv(RPC_BASE_ENV, "")
    monkeypatch.delenv(RPC_BASE_ENV)
    try:
        for length in (40, 70, 100):
            tmp = base / ("d" * (length - len(str(base)) - 1))
            tmp.mkdir()
            monkeypatch.setenv("TMPDIR", str(tmp))
            monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
            if length == 100:
                with pytest.raises(
                    ConfigError, match="too long for the KV failure inbox's Unix sockets.*shorter TMPDIR"
                ):
                    FailureInbox()
                continue
            inbox = FailureInbox()
            try:
                assert Path(inbox.path).parent.parent == tmp and len(inbox.path) <= 107
                assert Path(inbox.path).parent.name.startswith("pdcluster-kv-failures-" if length == 40 else "pdc-")
            finally:
                inbox.close()
            made = private_ipc_dir()
            if length == 40:
                assert Path(made).parent == tmp and len(made) + 1 + 36 <= 107
                monkeypatch.delenv(RPC_BASE_ENV)
            else:
                assert made is None and RPC_BASE_ENV not in os.environ  # vLLM's default: TMPDIR itself
    finally:
        shutil.rmtree(base)
