"""Where a test run's time and CPU went: a pytest plugin, and a summary of what it wrote.

On 2 cores the two lanes keep the machine busy through a run, so the suite takes as long as its
CPU work: a test that starts processes costs the other lane too. With PDCLUSTER_TEST_TIMELINE
set to a directory, `make test` (tools/test_lanes.py) loads this plugin into both lanes, and each
writes `timeline-<lane>.jsonl` there: one row per test with when it started (seconds into its
lane), its wall time, this process's CPU time and that of the child processes reaped meanwhile
(engines and interpreters the test started and stopped; a fixture's engines count where they stop;
a Ray cluster's processes, which `up` leaves running on their own, are counted nowhere), and
what the whole machine's cores were busy meanwhile (/proc/stat: both lanes, Ray, the kernel).

    PDCLUSTER_TEST_TIMELINE=/tmp/timeline make test
    python tools/test_timeline.py /tmp/timeline [--top 20]

prints, per lane, each module's start and end (minutes into the lane), wall and CPU seconds, then
the tests that spent the most CPU, and how busy the machine's cores were over the lane (a
lane's time is the suite's CPU work only while that share stays near 100 %).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

TIMELINE_ENV = "PDCLUSTER_TEST_TIMELINE"
LANES = ("clusters", "engines")


def _machine_busy() -> float | None:
    """CPU-seconds the machine's cores have spent busy since boot (every process, the kernel's
    own threads), or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class Timeline:
    """The plugin: one JSON row per test (setup, call and teardown together)."""

    def __init__(self, path: Path):
        self.began = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.out = path.open("w", buffering=1)
        self.outcomes: dict[str, str] = {}  # test id -> its first phase that did not pass

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        own, children = _cpu()
        busy = _machine_busy()
        started = time.monotonic()
        yield
        own_after, children_after = _cpu()
        busy_after = _machine_busy()
        row = {
            "id": item.nodeid,
            "start": round(started - self.began, 3),
            "wall": round(time.monotonic() - started, 3),
            "cpu": round(own_after - own, 3),
            "children_cpu": round(children_after - children, 3),
            "outcome": self.outcomes.pop(item.nodeid, "passed"),
            "machine_busy": None if busy is None or busy_after is None else round(busy_after - busy, 3),
        }
        self.out.write(json.dumps(row) + "\n")

    def pytest_runtest_logreport(self, report):
        if report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)

    def pytest_unconfigure(self, config):
        self.out.close()


def pytest_configure(config):
    directory = os.environ.get(TIMELINE_ENV)
    if directory:
        lane = os.environ.get("PDCLUSTER_TEST_LANE", "session")
        config.pluginmanager.register(Timeline(Path(directory) / f"timeline-{lane}.jsonl"), "pdcluster-timeline")


def module_of(test_id: str) -> str:
    module = test_id.split("::")[0]
    return "tests/unit" if module.startswith("tests/unit/") else module


def summary(directory: Path, top: int = 20) -> str:
    lines = []
    for path in sorted(directory.glob("timeline-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows:
            continue
        modules: dict[str, list[float]] = {}
        for row in rows:
            start, end, wall, cpu = modules.setdefault(module_of(row["id"]), [row["start"], 0.0, 0.0, 0.0])
            modules[module_of(row["id"])] = [
                min(start, row["start"]),
                max(end, row["start"] + row["wall"]),
                wall + row["wall"],
                cpu + row["cpu"] + row["children_cpu"],
            ]
        lane = path.stem.removeprefix("timeline-")
        lines.append(f"== {lane}: {len(rows)} tests, {max(m[1] for m in modules.values()) / 60:.1f} min")
        busy = [(row["wall"], row["machine_busy"]) for row in rows if row.get("machine_busy") is not None]
        if busy:
            cores, wall = os.cpu_count() or 1, sum(w for w, _ in busy)
            share = sum(b for _, b in busy) / (wall * cores) if wall else 0.0
            lines.append(f"the machine's {cores} cores were {share:.0%} busy while this lane's tests ran")
        lines.append(f"{'start':>6} {'end':>6} {'wall s':>7} {'CPU s':>7}  module")
        for module, (start, end, wall, cpu) in modules.items():
            lines.append(f"{start / 60:6.1f} {end / 60:6.1f} {wall:7.0f} {cpu:7.0f}  {module}")
        lines.append(f"{'wall s':>7} {'CPU s':>7}  the {top} tests that spent the most CPU (own + reaped children)")
        for row in sorted(rows, key=lambda r: -(r["cpu"] + r["children_cpu"]))[:top]:
            lines.append(f"{row['wall']:7.1f} {row['cpu'] + row['children_cpu']:7.1f}  {row['id']}")
    return "\n".join(lines) if lines else f"no timeline-*.jsonl in {directory}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarize the timelines a test run wrote.")
    parser.add_argument("directory", type=Path, help=f"what {TIMELINE_ENV} named")
    parser.add_argument("--top", type=int, default=20, help="how many of the costliest tests to list")
    args = parser.parse_args(argv)
    sys.stdout.write(summary(args.directory, args.top) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
