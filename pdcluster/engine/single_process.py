"""Single-process CPU engines: the model runs in the engine-core process, beside the scheduler.

vLLM's CPU platform always runs the model in a separate worker process (its multiprocessing
executor), even for one worker, because that is where it can give OpenMP its thread binding (env
vars set before the worker starts). Every step then crosses two processes: the engine core writes
the step to a shared-memory queue and wakes the worker, the worker runs the forward and writes the
result back, and the engine core wakes to read it. On a small host each of those wake-ups waits
for a core, and a worker that busy-waits for its next step burns one.

With one worker (tensor parallel size 1) and an explicit core list, pdcluster runs the model in
the engine-core process instead (vLLM's `uni` executor): `SingleProcessCPUWorker` binds the
engine-core thread that will run the forwards to the role's cores and sets torch's thread count
before vLLM's CPU worker initialises (threads that thread starts later inherit the binding, as
the worker process's threads do on the multiprocessing path). One thread schedules and computes;
no step crosses a process. What that does to decode ITL and TPOT under interference is measured
in bench/results/2026-11-30-serve.md (summarised in the README).

The vLLM internals this relies on (CPUWorker.init_device's ordering, vLLM's core-list parser, the
executor fields of ParallelConfig) are reached through pdcluster.compat.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pdcluster import compat
from pdcluster.engine.cpu_bind import bind_this_thread, explicit_cores

logger = logging.getLogger(__name__)

WORKER_CLS = f"{__name__}.SingleProcessCPUWorker"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def use_single_process(vllm_config: Any, cores: list[int] | None) -> str | None:
    """Switch a CPU engine's config to the in-process executor; returns why not, or None.

    Called for CPU engines, on the config vLLM's platform has already adjusted (it sets `mp`)."""
    world_size, backend, worker_cls = compat.executor_choice(vllm_config)
    if world_size != 1:
        return f"{world_size} workers (tensor/pipeline parallel) need worker processes"
    if cores is None:
        return "no explicit core list (cpu_bind) to bind the engine thread to"
    if backend not in ("mp", "uni"):
        return f"executor {backend!r} chosen explicitly"
    if worker_cls not in ("auto", compat.cpu_worker_name(), WORKER_CLS):
        return f"worker class {worker_cls!r} chosen explicitly"
    compat.run_model_in_engine_core(vllm_config, WORKER_CLS)
    return None


class SingleProcessCPUWorker(compat.cpu_worker_base()):
    """vLLM's CPU worker, bound in place of the worker process vLLM would have started."""

    def init_device(self) -> None:
        cores = explicit_cores(os.environ.get(BIND_ENV))
        if cores is None:
            raise RuntimeError(f"single-process CPU engine without an explicit {BIND_ENV}")
        # The engine core runs its busy loop on the thread that builds its executor: this one.
        bind_this_thread(cores)  # before CPUWorker.init_device disables torch.set_num_threads
        logger.info("engine thread bound to cores %s (%d torch threads), model in the engine core", cores, len(cores))
        super().init_device()
