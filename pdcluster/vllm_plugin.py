"""vLLM general plugins: the process-level fixes pdcluster's engine processes need.

vLLM loads `vllm.general_plugins` entry points in each process it starts (API process, engine
core, workers) before a model runs, and it loads every installed one unless VLLM_PLUGINS (an
allow-list of names) says otherwise. Both of ours are gated so that a stock `vllm serve` in the
same venv stays stock:

- `pdcluster_cpu_fixes` (`register`) acts only in processes pdcluster launched for an engine
  (the ENGINE_MARKER_ENV that EngineSpec.env() sets; engine-core and worker processes inherit
  it). There it checks the vLLM version (pdcluster/compat) and applies:
  - logging: the `pdcluster` logger gets a handler in engine processes vLLM spawns;
  - AMX permission (see request_amx_permission);
  - lifetime: the process dies with its parent (engine/lifetime.py), so a killed actor leaves
    no engine core or worker behind;
  - step queues: vLLM's shared-memory queues between engine core and workers drop wake-up pings
    to a reader that sleeps (compat.keep_queue_pings), and spin for 1 s after each message
    (compat.set_queue_reader_spin, per role from the config, see spin_for_this_process);
  - idle steps: an engine core whose requests only wait on our connector waits for it instead
    of stepping every 1 ms (compat.wait_between_idle_steps, kv_transfer/colocated.py).
  - sampled requests with speculative decoding on CPU: vLLM's CPU fallback spreads their
    temperature, top_k and top_p over draft tokens as uninitialized memory, and a top_k-only
    step without drafts kills the engine core (compat.fix_cpu_spec_sampling).
  - progress bars: tqdm's lock within the process (see keep_progress_bars_in_process).
- `pdcluster_amx_permission` (`register_amx_permission`) only requests AMX permission, and only
  where VLLM_PLUGINS names it: the one fix a stock vLLM needs on AMX CPUs to decode on
  transferred KV at all (bench/serve.py's vLLM P/D baseline loads it there, and nothing else).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import platform
import threading

from pdcluster import compat
from pdcluster.engine.dtype import cpu_flags
from pdcluster.engine.lifetime import die_with_parent
from pdcluster.engine.spec import WORKER_SPIN_ENV

logger = logging.getLogger(__name__)

AMX_PLUGIN = "pdcluster_amx_permission"  # entry point name (pyproject.toml)

# How often a reader that stopped spinning re-reads its queue (vLLM: every 5 s).
IDLE_RECHECK_MS = 20

_SYS_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_amx_requested: bool | None = None


def cpu_has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission for this process. Idempotent; True on success.

    vLLM's CPU attention kernel executes AMX tile instructions but never asks the kernel for
    permission to use them. It only works when oneDNN asked first (during a multi-token GEMM,
    i.e. a prefill). A decode engine whose first step runs on transferred KV reaches the AMX
    kernel first and dies with SIGILL. A Linux syscall (arch_prctl), not a vLLM reach."""
    global _amx_requested
    if _amx_requested is not None:
        return _amx_requested
    _amx_requested = False
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not cpu_has_amx():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        logger.warning(
            "AMX permission request failed (errno %d); decode on transferred KV may crash",
            ctypes.get_errno(),
        )
        return False
    _amx_requested = True
    logger.debug("AMX tile-data permission granted to pid %d", os.getpid())
    return True


def spin_for_this_process(worker_spin_ms: float) -> float:
    """The configured spin for a worker; none for an engine core.

    An engine core reads only its workers' results, which come a whole forward pass after it
    sent the step: spinning for them burns a core the router, the frontends and (on a shared
    host) the other engine need, and on a 2-core host makes both cores look busy to the kernel,
    which then puts those processes on the decode core. Woken by its worker's ping instead
    (reliable with keep_queue_pings); the interference workload's ITL and the engine core's CPU
    time with and without the spin are in bench/results/2026-11-30-serve.md. A worker's next
    step comes a millisecond or two after its result, so workers keep the spin.
    """
    name = multiprocessing.current_process().name
    return 0.0 if name.startswith("EngineCore") else worker_spin_ms


def set_worker_spin(worker_spin_ms: float) -> None:
    """Shorten this process's step-queue spin to `worker_spin_ms` (compat.set_queue_reader_spin).

    With vLLM's 1 s spin readers seldom sleep; with a short one they sleep between most steps,
    so a sleeping reader also re-reads its queue every IDLE_RECHECK_MS instead of every 5 s."""
    _, recheck_ms = compat.queue_reader_spin()
    compat.set_queue_reader_spin(worker_spin_ms / 1e3, min(recheck_ms, IDLE_RECHECK_MS))


def keep_progress_bars_in_process() -> None:
    """tqdm's bars (vLLM's weight loading) share one write lock across processes unless told
    otherwise: a multiprocessing RLock, which a spawned process (an engine core) makes as a named
    semaphore in /dev/shm. Only the resource tracker unlinks it when the process dies without
    cleaning up, and a replica whose engine core died has its actor, tracker and all, killed:
    each such death left a `sem.mp-*` file behind. An engine process's bars go to its own log,
    so a lock within the process serves them. (tqdm's public `set_lock`; not a vLLM reach.)"""
    try:
        from tqdm import tqdm
    except ImportError:  # no bars to lock
        return
    tqdm.set_lock(threading.RLock())


def register() -> None:
    """Entry point `pdcluster_cpu_fixes`: our engine processes' fixes; nothing elsewhere."""
    if not compat.is_pdcluster_engine_process():
        return
    from pdcluster.logs import setup_logging

    setup_logging()  # our connector logs from vLLM's engine processes too
    die_with_parent()
    compat.require_tested_vllm()
    request_amx_permission()
    if os.environ.get(WORKER_SPIN_ENV):
        set_worker_spin(spin_for_this_process(float(os.environ[WORKER_SPIN_ENV])))
    compat.keep_queue_pings()
    compat.fix_cpu_spec_sampling()  # sampled requests with MTP on CPU (compat/vllm_sampling.py)
    keep_progress_bars_in_process()
    from pdcluster.kv_transfer import colocated

    compat.wait_between_idle_steps(colocated.idle_wait, colocated.outputs_queued)
    spin_s, recheck_ms = compat.queue_reader_spin()
    logger.debug(
        "engine process fixes applied in %s: queue spin %g s, re-check %d ms, pings kept",
        multiprocessing.current_process().name,
        spin_s,
        recheck_ms,
    )


def register_amx_permission() -> None:
    """Entry point `pdcluster_amx_permission`: AMX permission, where VLLM_PLUGINS names it."""
    if AMX_PLUGIN in os.environ.get("VLLM_PLUGINS", "").split(","):
        request_amx_permission()
