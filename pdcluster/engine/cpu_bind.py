"""Binding an engine's threads to its cores (roles.<role>.cpu_bind, CPU).

Two scopes (roles.<role>.cpu_bind_scope):
- `engine` (default): the thread that runs the forwards binds itself (single_process.py, or
  vLLM's worker process through VLLM_CPU_OMP_THREADS_BIND); the threads it starts inherit that.
  Everything else of the replica runs wherever the kernel puts it: vLLM's front end (the HTTP
  app, tokenising, detokenising, streaming), the actor's Ray threads, and the engine-core
  process's socket threads.
- `replica`: every thread of the process hosting the engine is bound before the engine starts,
  so every process the engine spawns (engine core, workers) and every thread started later
  inherit the same cores. Work a replica does outside its forwards then cannot land on another
  role's core: on a small host, a decode request admitted ahead of its prefill (decode_ahead)
  otherwise takes CPU from the prefill it waits for. The cost: that work now shares the
  replica's own cores with its forwards.
Processes that are no replica (router, controller, Ray's own) are not bound either way.
"""

from __future__ import annotations

import errno
import os

from pdcluster import compat
from pdcluster.errors import ConfigError


def explicit_cores(mask: str | None) -> list[int] | None:
    """The cores of a VLLM_CPU_OMP_THREADS_BIND value naming one core list ('1', '0-3', '0,2'),
    read by vLLM's own parser for that variable; None for vLLM's 'auto' / 'nobind', an empty or
    unreadable value, or one list per rank ('0-1|2-3')."""
    if not mask or mask in ("auto", "nobind") or "|" in mask:
        return None
    try:
        return compat.parse_cpu_list(mask) or None
    except ValueError:
        return None


def _set_affinity(tid: int, cores: list[int]) -> None:
    """sched_setaffinity, its refusal of cores outside this machine's CPU set said as such."""
    try:
        os.sched_setaffinity(tid, cores)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        allowed = sorted(os.sched_getaffinity(0))
        raise ConfigError(
            f"roles.<role>.cpu_bind: cores {cores} are not all among the CPUs this process may use {allowed}"
        ) from None


def bind_this_thread(cores: list[int]) -> None:
    """Bind the calling thread to `cores` and give torch (OpenMP) one thread per core."""
    import torch

    _set_affinity(0, cores)  # pid 0: the calling thread
    torch.set_num_threads(len(cores))


def bind_this_process(cores: list[int]) -> int:
    """Bind every thread of this process to `cores` (threads and processes started later by any
    of them inherit it); returns how many threads were bound. A thread started meanwhile by a
    thread not yet bound is caught by the next pass: passes repeat until one finds none new."""
    bound: set[int] = set()
    while True:
        new = {int(tid) for tid in os.listdir("/proc/self/task")} - bound
        if not new:
            return len(bound)
        for tid in new:
            try:
                _set_affinity(tid, cores)
            except ProcessLookupError:
                continue  # the thread ended meanwhile
            bound.add(tid)
