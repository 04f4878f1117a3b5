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
10 ms, when and how late it woke): stalls only the client had.

Usage: python bench/serve_client.py --watch-log PATH [--freeze-heap] bench serve [vLLM flags...]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcluster import compat, vllm_cli  # noqa: E402

TICK_S = 0.01  # the watch thread's wake-up interval
LATE_S = 0.05  # a wake-up this much late is recorded


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

    def watch() -> None:
        while True:
            before = time.perf_counter()
            if done.wait(TICK_S):
                return
            now = time.perf_counter()
            if now - before - TICK_S > LATE_S:  # [when (s since the watch began), how late (ms)]
                late.append([round(now - began, 2), round((now - before - TICK_S) * 1e3, 1)])

    threading.Thread(target=watch, daemon=True).start()
    try:
        return vllm_cli.main(vllm_args)
    finally:
        done.set()
        args.watch_log.write_text(json.dumps({"gc_pauses_ms": pauses, "late": late}))


if __name__ == "__main__":
    sys.exit(main())
