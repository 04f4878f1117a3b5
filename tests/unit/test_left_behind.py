"""The KV secret's file on each node (engine/actor.py): private, and not left behind by an actor
killed in the middle of its engine's start (the file is removed once the engine runs, which that
actor never reached): the next engine started on the node removes it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

from pdcluster.engine.actor import write_secret_file
from pdcluster.pidfds import pid_namespace

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
        assert os.path.basename(path).startswith(f"pdcluster-kv-c-decode-1.{pid_namespace()}-{os.getpid()}.")
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
    boot, inode = namespace[:12], int(namespace[12:])
    elsewhere = [  # another pid namespace of this kernel; the same one of another machine's
        tmp_path / f"pdcluster-kv-c-decode-0.{boot}{inode + 1}-{gone.pid}.abc123.secret",
        tmp_path / f"pdcluster-kv-c-decode-1.{'f' * 12}{inode}-{gone.pid}.abc124.secret",
    ]
    here = tmp_path / f"pdcluster-kv-c-decode-2.{namespace}-{gone.pid}.def456.secret"
    for path in (*elsewhere, here):
        path.write_text("the-secret")
    write_secret_file("c-prefill-0", "the-secret", str(tmp_path))
    assert all(path.exists() for path in elsewhere) and not here.exists()
