"""engine/vllm_segments.py: vLLM's shared-memory queues of a killed engine host are removed by
the next host started in its pid namespace.

A host (a process group of its own, as a Ray actor is) starts a child that makes a multiprocessing
segment and attaches to one the test made, as vLLM's engine core and worker do with their queues,
and records them as an engine host does. The child's resource tracker is told to forget both: in
an engine the tracker is the host's child, in the host's process group, and Ray ends an actor by
killing its children and that group, tracker included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from pdcluster.engine.vllm_segments import mapped_segments, release, remove_left_segments
from tests.support.engines import REPO

CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
made = shared_memory.SharedMemory(create=True, size=1 << 20)
attached = shared_memory.SharedMemory(name=sys.argv[1])
for segment in (made, attached):
    resource_tracker.unregister(segment._name, "shared_memory")
print(made.name, flush=True)
time.sleep(600)
"""
HOST = """
import subprocess, sys, time
from pdcluster.engine.vllm_segments import record_segments
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
made = child.stdout.readline().strip()
print(made, child.pid, record_segments(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def segments():
    """The paths of the segments the test's processes use, removed at the end whatever is left:
    first one the test makes for the child to attach to (an engine core's queue, to its worker)."""
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(segment._name, "shared_memory")
    paths = [f"/dev/shm/{segment.name}"]
    yield paths
    segment.close()
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def start_host(paths: list[str]) -> tuple[subprocess.Popen, Path]:
    attach = paths[0].rpartition("/")[2]
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, CHILD, attach], stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    made, child, record = host.stdout.readline().split()
    paths.append(f"/dev/shm/{made}")
    assert set(mapped_segments(int(child))) == set(paths)  # what the record is made from
    return host, Path(record)


def test_a_killed_hosts_segments_are_removed_by_the_next_host(segments):
    host, record = start_host(segments)
    os.killpg(host.pid, signal.SIGKILL)  # how Ray ends an actor
    host.wait(10)
    # Nothing else removes them (what a replica the controller replaced left before):
    assert all(os.path.exists(path) for path in segments) and record.exists()
    remove_left_segments()  # what the next engine host does first
    assert [path for path in segments if os.path.exists(path)] == [] and not record.exists()


def test_a_running_hosts_segments_are_left_alone(segments):
    host, record = start_host(segments)
    try:
        remove_left_segments()
        assert all(os.path.exists(path) for path in segments) and record.exists()
    finally:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait(10)
        record.unlink()


def test_only_the_segments_recorded_are_removed(tmp_path):
    segment = shared_memory.SharedMemory(create=True, size=4096)
    path = f"/dev/shm/{segment.name}"
    inode = os.stat(path).st_ino
    outside = tmp_path / "psm_not_in_dev_shm"
    outside.write_bytes(b"")
    record = tmp_path / "record.json"
    try:
        for recorded in ({path: inode + 1}, {str(outside): outside.stat().st_ino}, {"/dev/shm/psm_../x": 1}):
            record.write_text(json.dumps(recorded))
            assert release(record) == []  # another inode (a new segment of that name), not a segment
        assert os.path.exists(path) and outside.exists()
        record.write_text("{")  # a host killed while it wrote it
        assert release(record) == []
        record.write_text(json.dumps({path: inode}))
        assert release(record) == [path] and not os.path.exists(path)
        assert release(record) == []  # gone already (its maker's clean shutdown)
    finally:
        segment.close()
        if os.path.exists(path):
            os.unlink(path)
        else:
            resource_tracker.unregister(segment._name, "shared_memory")
