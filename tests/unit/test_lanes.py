"""tools/test_lanes.py turns the kernel's session autogrouping off for the suite and back on after
it (tools/autogroup.py, which bench/serve.py's --no-autogroups uses too). A file stands in for
/proc/sys/kernel/sched_autogroup_enabled: the real switch is the machine's, and the other lane
runs while these tests do."""

from __future__ import annotations

import pytest

from tools.test_lanes import threads_scheduled_alone


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
