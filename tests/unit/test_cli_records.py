"""Cluster records whose Ray is gone: `status`, `scale` and `down` clean them with one line each
and never show a traceback (real processes and sockets: a Ray head that exited, a GCS port that
nobody listens on)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDCLUSTER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "pdcluster.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def gone_process_group() -> int:
    """The pid (and process group) of a Ray head that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    return proc.pid


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens once closed


@pytest.fixture
def home(tmp_path):
    # Never Ray's default port: a cluster another lane runs there would be live (tools/test_lanes.py).
    records = {
        "started": {"ray_address": closed_address(), "head_pid": gone_process_group()},
        "joined": {"ray_address": closed_address(), "head_pid": None},
    }
    for name, fields in records.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"name": name, "namespace": "pdcluster", **fields}))
    return tmp_path


def assert_one_line_each(result: subprocess.CompletedProcess) -> list[str]:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr + result.stdout
    assert all(line.startswith("pdcluster: ") for line in lines), lines
    return lines


@pytest.mark.parametrize("command", [["status"], ["scale", "decode", "2"]])
def test_stale_records_are_removed_instead_of_blocking_commands_without_a_name(home, command):
    result = cli(home, *command)
    lines = assert_one_line_each(result)
    assert result.returncode == 2
    removed = [line for line in lines if "removed the record" in line]
    assert (
        len(removed) == 2
        and any("'started'" in line for line in removed)
        and any("'joined'" in line for line in removed)
    )
    assert lines[-1] == "pdcluster: no running cluster (pdcluster up FILE starts one)"
    assert list(home.glob("*.json")) == []


def test_down_of_a_stale_cluster_is_one_line_and_exit_0(home):
    address = json.loads((home / "started.json").read_text())["ray_address"]
    result = cli(home, "down", "--name", "started")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout.strip() == f"pdcluster started: its Ray ({address}) is gone; removed its record"
    assert not (home / "started.json").exists() and (home / "joined.json").exists()


def test_ctrl_c_while_the_local_ray_head_starts_stops_it(tmp_path, monkeypatch):
    """`up` interrupted (Ctrl-C) while its Ray head starts: the head runs in a session of its own,
    so the signal does not reach it, and no record names it yet; it once ran on for good. Here a
    stand-in head that never says it started (it writes its pid and sleeps)."""
    import _thread
    import signal
    import threading
    import time

    from pdcluster.orchestrator import session
    from pdcluster.pidfds import group_running

    pid_file = tmp_path / "head.pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    monkeypatch.setattr(session, "ray_command", lambda: [sys.executable, "-c", code])

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll for the stand-in head's pid
        _thread.interrupt_main()  # what Ctrl-C does to `up`

    # Ctrl-C's own handler: a test run started in the background (`make test &`) inherits SIGINT
    # ignored, and interrupt_main() then does nothing
    monkeypatch.setattr(session, "HEAD_START_TIMEOUT_S", 60)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            session.start_local_head(None, tmp_path / "head.log")
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = int(pid_file.read_text())
    assert not group_running(pid)


@pytest.mark.parametrize("form", ["[::1]:{port}", "ray://127.0.0.1:{port}", "127.0.0.1:{port}"])
def test_a_joined_clusters_record_stays_while_its_address_answers(form):
    """A joined cluster's record was judged by one TCP connect to `rpartition(":")` of its
    address: "[::1]:6379" and "ray://head:10001" never resolved, so status, scale and down removed
    the record of a live cluster (down then reported success and stopped nothing). Every form
    that answers keeps its record; a refused port is gone; a name that does not resolve proves
    nothing."""
    from pdcluster.orchestrator.session import Session

    family, host = (socket.AF_INET6, "::1") if form.startswith("[") else (socket.AF_INET, "127.0.0.1")
    try:
        listener = socket.socket(family)
        listener.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    listener.listen()
    try:
        port = listener.getsockname()[1]
        assert not Session("c", form.format(port=port), "ns").is_stale()
    finally:
        listener.close()
    assert Session("c", form.format(port=port), "ns").is_stale()  # now refused
    assert not Session("c", "no-such-host.invalid:6379", "ns").is_stale()
