"""Run the whole test suite as two pytest sessions at once (what `make test` runs).

Run one after the other, the suite leaves most of this 2-core machine idle: an engine start is
one core importing Python for ~20 s, and fault tests wait out leases and timeouts. So it runs
as two lanes, each one pytest session:
  clusters  every module that runs `pdcluster up` on this machine's own network
            (tests/support/cluster.cluster_up): real Ray clusters, one at a time, never two Ray
            heads on one network at once
  engines   everything else: the unit tests, the modules that start engines directly, and
            test_multinode, whose Ray nodes run on test hosts (network namespaces, each with its
            own network and Ray state directory; tests/support/hosts.py)
A module not named in CLUSTER_MODULES runs in the engines lane; one that starts a cluster on
this machine's network there is refused with that reason (tests/support/cluster.py checks
PDCLUSTER_TEST_LANE). Test hosts take a subnet no other lane holds. The suite's time is the
longer lane's: BALANCE_MODULES, engine-only modules, run at the end of the clusters lane so
that the two end together (both lanes' durations are printed; move a module when they drift).

The clusters lane prints as it runs; the engines lane's output follows when it is done. The
exit status is the first non-zero one (pytest's 5, no tests collected, counts as a failure).
Arguments are passed to both pytest sessions (e.g. `-x`, `-k name`). With PDCLUSTER_TEST_TIMELINE
set to a directory, each lane writes every test's wall and CPU time there (tools/test_timeline.py).

Ray's memory monitor is off for the Ray clusters the lanes start (LANE_ENV). Where the kernel
groups threads by session for scheduling (autogroup) and this runs as root,
grouping is off for the run and as it was after it (tools/autogroup.py: on these machines' kernel,
groups starved each other for 10-30 s, and lease and health-check tests failed for it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools import autogroup  # noqa: E402

CLUSTER_MODULES = [
    "tests/e2e/test_cluster.py",
    "tests/e2e/test_foreground.py",
    "tests/e2e/test_kv_faults.py",
    "tests/e2e/test_planner.py",
    "tests/e2e/pd",  # test_reliability, test_routing, test_security: one cluster (pd/conftest.py)
]
# Modules that start engines directly (no cluster), run at the end of the clusters lane to even
# the lanes out, after pd/, whose cluster (~9 GB of engines and actors) stops with its package.
# (With none here the engines lane ended ~6 min after this one; test_mtp_pd went back to the
# engines lane when the multi-host module there stopped starving: its test hosts' Ray workers had
# run at nice 15 beside this lane's.)
BALANCE_MODULES = ["tests/e2e/test_bf16_identity.py"]
# Ray's memory monitor kills a node's actors when the *machine's* memory runs high: the two lanes'
# engines share one machine, and it killed one lane's controller for the other lane's engines.
# Off for the Ray clusters the tests start (the kernel's OOM killer still guards the machine).
LANE_ENV = {"RAY_memory_monitor_refresh_ms": "0"}
# Each lane ends with its slowest tests (setup, call and teardown apart): the suite's time budget
# is kept by reading them.
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "--durations=25", "--durations-min=10"]


@contextlib.contextmanager
def threads_scheduled_alone(switch: Path = autogroup.SWITCH) -> Iterator[str]:
    """Session autogrouping off while the block runs, where the kernel has it on and lets this
    process change it; otherwise nothing changes. Yields one line saying what it did ('' where
    there was nothing to do)."""
    try:
        was = autogroup.turn_off(switch)
    except OSError as exc:
        yield f"test_lanes: kernel session autogrouping stays on ({switch}: {exc.strerror})"
        return
    if was is None:
        yield ""
        return
    try:
        yield f"test_lanes: kernel session autogrouping off for this run ({switch}, restored after)"
    finally:
        autogroup.restore(was, switch)


def lanes(extra: list[str]) -> dict[str, list[str]]:
    clusters = [*CLUSTER_MODULES, *BALANCE_MODULES]
    missing = [m for m in clusters if not (REPO / m).exists()]
    if missing:
        raise SystemExit(f"test_lanes: no such module {missing[0]} (CLUSTER_MODULES or BALANCE_MODULES in {__file__})")
    ignored = [f"--ignore={m}" for m in clusters]
    return {"clusters": [*clusters, *extra], "engines": ["tests", *ignored, *extra]}


def timeline_args() -> list[str]:
    """Each test's time and CPU, where PDCLUSTER_TEST_TIMELINE names a directory for them
    (tools/test_timeline.py)."""
    return ["-p", "tools.test_timeline"] if os.environ.get("PDCLUSTER_TEST_TIMELINE") else []


def main(argv: list[str]) -> int:
    with threads_scheduled_alone() as done:
        if done:
            sys.stdout.write(done + "\n")
            sys.stdout.flush()
        return run_lanes(argv)


def run_lanes(argv: list[str]) -> int:
    base = Path(tempfile.gettempdir()) / "pdcluster-tests"
    base.mkdir(mode=0o700, exist_ok=True)  # pytest makes each lane's --basetemp, not its parent
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    for lane, args in lanes(argv).items():
        env = dict(os.environ, PDCLUSTER_TEST_LANE=lane, **LANE_ENV)
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *timeline_args(), f"--basetemp={base / lane}", *args]
        if lane == "clusters":
            out = None  # inherits this terminal: printed as it runs
        else:
            logs[lane] = out = tempfile.TemporaryFile()
        procs[lane] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    codes = {lane: proc.wait() for lane, proc in procs.items()}
    for lane, log in logs.items():
        log.seek(0)
        sys.stdout.write(f"\n===== {lane} lane =====\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(log.read())
        sys.stdout.flush()
    for lane, code in codes.items():
        verdict = {0: "passed", 5: "collected no tests: failing"}.get(code, f"failed (exit {code})")
        sys.stdout.write(f"{lane} lane: {verdict}\n")
    return next((1 if code == 5 else code for code in codes.values() if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
