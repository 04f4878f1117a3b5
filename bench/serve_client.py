"""`vllm bench serve` as bench/serve.py runs it: vLLM's own client (through pdcluster.vllm_cli),
with the pauses of its full garbage collections recorded.

The client is a Python process that has imported vLLM, transformers and torch: some 600k
objects its collector tracks, so one full collection pauses it for about a third of a second
here. Paused, it reads none of its streams; the gap it then records for every stream open at
that moment is the client's, not the server's. A client on another machine would have the same
pauses, but they would not be the server's either, and here they land inside the SLO's gaps.
`--freeze-heap` freezes the client's startup heap before the run (as vLLM's own server does with
its heap, vllm.utils.gc_utils.freeze_gc_heap), so its full collections walk only what the run
allocated; the pauses are recorded either way (`--gc-log`: a JSON list of milliseconds).

Usage: python bench/serve_client.py --gc-log PATH [--freeze-heap] bench serve [vLLM flags...]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcluster import compat, vllm_cli  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--gc-log", type=Path, required=True)
    parser.add_argument("--freeze-heap", action="store_true")
    args, vllm_args = parser.parse_known_args()
    if args.freeze_heap:
        compat.answer_vllm_version_lookup()
        compat.cli_main()  # vLLM's CLI and what it imports, before the freeze
        import vllm.benchmarks.serve  # noqa: F401

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
    try:
        return vllm_cli.main(vllm_args)
    finally:
        args.gc_log.write_text(json.dumps(pauses))


if __name__ == "__main__":
    sys.exit(main())
