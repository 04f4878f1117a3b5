"""tools/test_lanes.py turns the kernel's session autogrouping off for the suite and back on after
it (tools/autogroup.py, which bench/serve.py's --no-autogroups uses too). A file stands in for
/proc/sys/kernel/sched_autogroup_enabled: the real switch is the machine's, and the other lane
runs while these tests do. Its timeline plugin (tools/test_timeline.py) in a pytest session of
its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.test_lanes import threads_scheduled_alone
from tools.test_timeline import TIMELINE_ENV, summary

REPO = Path(__file__).resolve().parents[2]


def test_autogrouping_is_off_inside_the_run_and_as_it_was_after_it(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    with threads_scheduled_alone(switch) as done:
        assert switch.read_text() == "0"
        assert "off for this run" in done and str(switch) in done
    assert switch.read_text().strip() == "1"


def test_autogrouping_comes_back_when_the_run_fails(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    with pytest.raises(RuntimeError), threads_scheduled_alone(switch):
        raise RuntimeError("a lane crashed")
    assert switch.read_text().strip() == "1"


def test_nothing_changes_where_grouping_is_off_or_absent(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("0\n")
    with threads_scheduled_alone(switch) as done:
        assert done == ""
    assert switch.read_text() == "0\n"
    with threads_scheduled_alone(tmp_path / "absent") as done:
        assert done == ""
    assert not (tmp_path / "absent").exists()


INNER = """
import subprocess, sys, pytest
def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "sum(range(10 ** 6))"], check=True)
def test_skipped():
    pytest.skip("not here")
def test_fails():
    assert False
"""


def test_the_timeline_has_a_row_per_test_with_its_outcome_and_its_childrens_cpu(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    out = tmp_path / "timeline"
    env = dict(os.environ, PYTHONPATH=str(REPO), PDCLUSTER_TEST_LANE="engines", **{TIMELINE_ENV: str(out)})
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tools.test_timeline", "-p", "no:cacheprovider"]
        + ["-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]  # one test failed
    rows = [json.loads(line) for line in (out / "timeline-engines.jsonl").read_text().splitlines()]
    by_name = {row["id"].split("::")[1]: row for row in rows}
    assert {name: row["outcome"] for name, row in by_name.items()} == {
        "test_starts_a_process": "passed",
        "test_skipped": "skipped",
        "test_fails": "failed",
    }
    started, skipped = by_name["test_starts_a_process"], by_name["test_skipped"]
    assert started["children_cpu"] > 0 and skipped["children_cpu"] == 0
    assert started["machine_busy"] > 0  # the machine's cores ran that process, at least
    assert skipped["start"] >= started["start"] + started["wall"] - 0.01  # one after the other
    text = summary(out)
    assert "== engines: 3 tests" in text and "test_inner.py::test_starts_a_process" in text
    assert re.search(r"the machine's \d+ cores were \d+% busy while this lane's tests ran", text), text
