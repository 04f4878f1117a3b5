"""`vllm bench serve` as bench/serve.py runs it: vLLM's own client (through pdcluster.vllm_cli),
with the pauses of its full garbage collections recorded.

The client is a Python process that has imported vLLM, transformers and torch: some 600k
objects its collector tracks, so one full collection pauses it for about a third of a second
here. Paused, it reads none of its streams; the gap it then records for every stream open at
that moment is the client's, not the server's. A client on another machine would have the same
pauses, but they would not be the server's either, and here they land inside the SLO's gaps.
`--freeze-heap` freezes the client's startup heap before the run (as vLLM's own server does with
its heap, vllm.utils.gc_utils.freeze_gc_heap), so its full collections walk only what the run
allocated; the pauses are recorded either way (`--watch-log`: JSON, `gc_pauses_ms`), and so is
every time the process itself did not run for over 50 ms (`late`: a thread that wakes every
10 ms, when and how late it woke): stalls only the client had. Each such wake-up also says where
the time went, from the kernel's per-thread accounting (/proc/<pid>/task/<tid>/schedstat) and the
hypervisor's steal count (/proc/stat) over that tick: how long the event loop's thread ran (busy
in the client itself, holding the GIL), how long it and the watch thread waited runnable for a
CPU (descheduled), and how long the vCPUs were stolen. None of those: the thread was blocked.

Usage: python bench/serve_client.py --watch-log PATH [--freeze-heap] bench serve [vLLM flags...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcluster import compat, vllm_cli  # noqa: E402

TICK_S = 0.01  # the watch thread's wake-up interval
LATE_S = 0.05  # a wake-up this much late is recorded
USER_HZ = os.sysconf("SC_CLK_TCK")


def thread_ns(tid: int, pid: int | str = "self") -> tuple[int, int]:
    """(ns on a CPU, ns runnable waiting for one) of thread `tid` of process `pid` (this one's by default)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


def steal_ms() -> float:
    """Time the hypervisor ran something else on this VM's vCPUs, all vCPUs summed."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) * 1e3 / USER_HZ


def where(before: tuple, after: tuple) -> list[float]:
    """[event loop on CPU, event loop runnable, watch runnable, stolen] in ms between two
    samples of (event loop's thread_ns, watch's thread_ns, steal_ms)."""
    (loop_cpu0, loop_wait0), (_, watch_wait0), steal0 = before
    (loop_cpu1, loop_wait1), (_, watch_wait1), steal1 = after
    return [
        round((loop_cpu1 - loop_cpu0) / 1e6, 1),
        round((loop_wait1 - loop_wait0) / 1e6, 1),
        round((watch_wait1 - watch_wait0) / 1e6, 1),
        round(steal1 - steal0, 1),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--watch-log", type=Path, required=True)
    parser.add_argument("--freeze-heap", action="store_true")
    args, vllm_args = parser.parse_known_args()
    compat.answer_vllm_version_lookup()  # imports vLLM's CLI: before the freeze and the watch
    import vllm.benchmarks.serve  # noqa: F401

    if args.freeze_heap:
        gc.collect()
        gc.freeze()
    pauses: list[float] = []
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append(round((time.perf_counter() - started[0]) * 1e3, 2))

    gc.callbacks.append(timed)
    late: list[list[float]] = []
    done = threading.Event()
    began = time.perf_counter()

    loop_tid = threading.main_thread().native_id  # vllm bench serve's asyncio loop runs here

    def sample() -> tuple:
        return thread_ns(loop_tid), thread_ns(threading.get_native_id()), steal_ms()

    def watch() -> None:
        while True:
            before, counters = time.perf_counter(), sample()
            if done.wait(TICK_S):
                return
            now = time.perf_counter()
            if now - before - TICK_S > LATE_S:
                # [when (s since the watch began), how late (ms), *where(...)]
                late.append(
                    [round(now - began, 2), round((now - before - TICK_S) * 1e3, 1), *where(counters, sample())]
                )

    threading.Thread(target=watch, daemon=True).start()
    try:
        return vllm_cli.main(vllm_args)
    finally:
        done.set()
        args.watch_log.write_text(json.dumps({"gc_pauses_ms": pauses, "late": late}))


if __name__ == "__main__":
    sys.exit(main())
