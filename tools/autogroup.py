"""The kernel's session autogrouping (kernel.sched_autogroup_enabled), off for a run that starts
many sessions at once and as it was after it: the test suite (tools/test_lanes.py) and the
serving benchmark's --no-autogroups (bench/serve.py).

With autogroups on, the scheduler shares each CPU between sessions first and between a session's
threads second, and nice counts only within a session. What that cost on these machines' 6.18
kernel:
- the suite (each lane and each Ray node a session; each engine a test started was one too, then):
  one group's threads waited 10-30 s for a CPU while another group ran; the scheduler's debug view
  showed the running group's virtual time stand still while its weight changed every tick (its
  threads on both cores), so the waiting group never became eligible. Through one run, 22 process-samples
  waited over 5 s (the longest 31 s); with grouping off none waited over 2.2 s.
- the benchmark: its load generator, in a session of its own at nice -10, still waited runnable
  up to 0.3 s at a time while the cluster served, and recorded those waits as the servers' gaps
  (bench/results/2026-12-03-serve-sweep-probe-autogroup.md).
Ungrouped, every thread waits its turn among all of them, and nice applies across sessions.
"""

from __future__ import annotations

from pathlib import Path

SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def turn_off(switch: Path = SWITCH) -> str | None:
    """Autogrouping off. Returns the value to restore it to, or None where it was off already or
    the kernel has none; an OSError (PermissionError: not root) where it may not be changed."""
    try:
        was = switch.read_text().strip()
    except FileNotFoundError:
        return None
    if was == "0":
        return None
    switch.write_text("0")
    return was


def restore(was: str, switch: Path = SWITCH) -> None:
    switch.write_text(was)
