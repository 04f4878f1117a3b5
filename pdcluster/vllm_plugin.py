"""vLLM general plugin: process-level fixes every vLLM process of ours needs.

vLLM loads `vllm.general_plugins` entry points in each process it starts (API process, engine
core, workers) before a model runs, so this is the one place for per-process platform fixes.

- Logging: the `pdcluster` logger gets a handler in engine processes vLLM spawns.
- AMX permission (x86_64 Linux): vLLM's CPU attention kernel executes AMX tile instructions but
  never asks the kernel for permission to use them. It only works when oneDNN asked first (during
  a multi-token GEMM, i.e. a prefill). A decode engine whose first step runs on transferred KV
  reaches the AMX kernel first and dies with SIGILL. We request XTILEDATA permission up front.
- Step queues: vLLM's shared-memory queues between engine core and workers drop most wake-up
  pings to a reader that sleeps (`keep_queue_pings`), and spin for 1 s after each message
  (`set_worker_spin`, per role from the config).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import multiprocessing
import os
import platform

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_amx_requested: bool | None = None


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission for this process. Idempotent; True on success."""
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


NIXL_CPU_TUNING_ENV = "PDCLUSTER_NIXL_CPU_TUNING"
WORKER_SPIN_ENV = "PDCLUSTER_WORKER_SPIN_MS"


# How often a reader that stopped spinning re-reads its queue (vLLM: every 5 s).
IDLE_RECHECK_MS = 20


def set_worker_spin(milliseconds: float) -> bool:
    """How long vLLM's shared-memory queue readers busy-wait after a message before sleeping.

    Each engine worker reads its next step from such a queue, and for 1 s after every read it
    spins on sched_yield (vLLM's default) before it waits on a socket: a prefill engine that
    gets a request every few hundred ms never sleeps, and its spinning takes the cores the
    router, the frontends and the other engine need on a small CPU host.

    A sleeping reader is woken by the writer's ZMQ ping, which vLLM sends best-effort (a PUB
    socket with SNDHWM=1 drops it silently; `keep_queue_pings` makes room) and backs up by
    re-reading the queue every 5 s. With a 1 s spin readers seldom sleep; with a short one they
    sleep between most steps, and a lost ping stalled a busy engine for exactly 5 s (5.0 s gaps
    in bench/serve.py's streams). So a shortened spin also comes with a sleeping reader that
    re-reads its queue every IDLE_RECHECK_MS.
    Returns False where this vLLM has no such queue.
    """
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    init = inspect.unwrap(spin.__init__) if spin is not None else None  # under keep_queue_pings' wrapper
    defaults = getattr(init, "__defaults__", None)
    recheck = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
    if spin is None or defaults is None or len(defaults) != 1 or not isinstance(recheck, int):
        logger.warning("this vLLM's shm queues differ from the ones we tune; worker spin unchanged")
        return False
    init.__defaults__ = (milliseconds / 1e3,)
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(recheck, IDLE_RECHECK_MS)
    return True


def spin_for_this_process(worker_spin_ms: float) -> float:
    """The configured spin for a worker; none for an engine core.

    An engine core reads only its workers' results, which come a whole forward pass after it
    sent the step: spinning for them burns a core the router, the frontends and (on a shared
    host) the other engine need, and on a 2-core host makes both cores look busy to the kernel,
    which then puts those processes on the decode core. Woken by its worker's ping instead
    (reliable with keep_queue_pings): interference ITL p99 15.5 / 14.8 ms vs 17.2 / 16.7 with
    the spin (bench/serve.py's interference workload, P/D, alternating runs), the engine core's
    CPU 4.5 s instead of 14 s. A worker's next step comes a millisecond or two after its
    result, so workers keep the spin.
    """
    name = multiprocessing.current_process().name
    return 0.0 if name.startswith("EngineCore") else worker_spin_ms


# Pings a queue's writer may have in flight to a sleeping reader before ZMQ drops the next one.
PING_HWM = 1000


def keep_queue_pings() -> bool:
    """Make vLLM's shm-queue writers' wake-up pings reliable.

    A reader that stopped spinning sleeps on a ZMQ SUB socket (CONFLATE) and is woken by the
    writer's ping over a PUB socket that vLLM binds with SNDHWM=1: a ping sent while an earlier
    one still counts against that mark (an engine step sends two messages, execute then sample)
    is dropped silently, and the reader sleeps until its next re-check while its message waits.
    Measured with spin 0 (tests/unit/test_queue_pings.py): 198 of 300 two-message round trips
    waited for the re-check. With room for PING_HWM pings none do; the reader's CONFLATE still
    keeps at most one. Returns False where this vLLM's SpinCondition differs from the one we fix.
    """
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    original = getattr(spin, "__init__", None)
    if getattr(original, "_pdcluster_pings", False):
        return True
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    if params[:4] != ["self", "is_reader", "context", "notify_address"] or not hasattr(spin, "notify"):
        logger.warning("this vLLM's shm queues differ from the ones we fix; queue pings unchanged")
        return False

    class PingSocket(zmq.Socket):
        def setsockopt(self, option, value):  # vLLM's writer sets SNDHWM=1 before it binds
            if option == zmq.SNDHWM:
                value = max(value, PING_HWM)
            super().setsockopt(option, value)

    class PingContext:
        """The context vLLM's writer branch sees: its sockets are PingSockets."""

        def __init__(self, context):
            self._context = context

        def socket(self, kind, **kwargs):
            return self._context.socket(kind, socket_class=PingSocket, **kwargs)

        def __getattr__(self, name):
            return getattr(self._context, name)

    @functools.wraps(original)
    def init(self, is_reader, context, notify_address, *args, **kwargs):
        if not is_reader:
            context = PingContext(context)
        original(self, is_reader, context, notify_address, *args, **kwargs)

    init._pdcluster_pings = True  # type: ignore[attr-defined]
    spin.__init__ = init
    return True


def tune_nixl_for_cpu() -> None:
    """Run vLLM's NixlConnector the tuned way on CPU (the baseline of bench/serve.py).

    Opt-in (PDCLUSTER_NIXL_CPU_TUNING=1) and used for nothing else: on a small CPU host stock
    NIXL busy-polls a UCX progress thread (~1 core per engine) and pins each worker's model
    thread to the last core of its NUMA node, whatever VLLM_CPU_OMP_THREADS_BIND says.
    """

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    make_config = base_worker.nixl_agent_config
    if make_config is not None and not getattr(make_config, "_pdcluster_tuned", False):
        tuned = functools.partial(make_config, enable_prog_thread=False)
        tuned._pdcluster_tuned = True  # type: ignore[attr-defined]
        base_worker.nixl_agent_config = tuned
    worker_cls = base_worker.NixlBaseConnectorWorker
    original_init = worker_cls.__init__
    if getattr(original_init, "_pdcluster_tuned", False):
        return

    @functools.wraps(original_init)
    def init_keeping_affinity(self, *args, **kwargs):
        cpus = os.sched_getaffinity(0)
        original_init(self, *args, **kwargs)
        os.sched_setaffinity(0, cpus)

    init_keeping_affinity._pdcluster_tuned = True  # type: ignore[attr-defined]
    worker_cls.__init__ = init_keeping_affinity


def register() -> None:
    """Entry point named in pyproject.toml (`vllm.general_plugins`)."""
    from pdcluster.logs import setup_logging

    setup_logging()  # our connector logs from vLLM's engine processes too
    request_amx_permission()
    if os.environ.get(WORKER_SPIN_ENV):
        set_worker_spin(spin_for_this_process(float(os.environ[WORKER_SPIN_ENV])))
    keep_queue_pings()
    if os.environ.get(NIXL_CPU_TUNING_ENV) == "1":
        tune_nixl_for_cpu()
