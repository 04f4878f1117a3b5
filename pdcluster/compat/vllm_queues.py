"""vLLM's shared-memory step queues (engine core <-> workers): spin, re-check and wake-up pings.

Applied by our plugin (pdcluster/vllm_plugin.py) in engine processes pdcluster launched, before
vLLM makes its queues; the reasons are in each function's docstring.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

from pdcluster.compat.guard import VLLMShapeError, expect_attributes, expect_parameters, resolve

SHM_QUEUES = "vllm.distributed.device_communicators.shm_broadcast"
PING_HWM = 1000  # pings a writer may have in flight to a sleeping reader before ZMQ drops one


def _spin_condition_init() -> tuple[type, Callable]:
    spin = resolve(SHM_QUEUES, "SpinCondition")
    init = inspect.unwrap(spin.__init__)  # under keep_queue_pings' wrapper
    symbol = f"{SHM_QUEUES}.SpinCondition.__init__"
    expect_parameters(init, symbol, ["self", "is_reader", "context", "notify_address", "busy_loop_s"])
    if getattr(init, "__defaults__", None) is None or len(init.__defaults__) != 1:
        raise VLLMShapeError(f"{symbol}: expected one default (busy_loop_s)")
    expect_attributes(spin, f"{SHM_QUEUES}.SpinCondition", ["notify", "wait"])
    if not isinstance(resolve(SHM_QUEUES, "SHM_READER_RECHECK_INTERVAL_MS"), int):
        raise VLLMShapeError(f"{SHM_QUEUES}.SHM_READER_RECHECK_INTERVAL_MS is not an int (ms)")
    return spin, init


def set_queue_reader_spin(busy_loop_s: float, recheck_ms: int) -> None:
    """How long this process's shm-queue readers busy-wait after a message, and how often a
    reader that went to sleep re-reads its queue.

    Upstream: `shm_broadcast.SpinCondition.__init__`'s default `busy_loop_s` (1 s; MessageQueue
    builds its SpinCondition without passing it, so the default is the only knob) and the module
    global `SHM_READER_RECHECK_INTERVAL_MS` (5000, read each time a sleeping reader waits).
    Why: an engine worker reads its next step from such a queue and spins for 1 s after each
    one; on a small CPU host a worker that gets a step every few hundred ms never sleeps and
    takes a core other processes need. A shortened spin means readers sleep between steps and
    depend on the writer's ping (see keep_queue_pings), backed up by the re-check, which must
    then come sooner than 5 s (a lost ping otherwise stalls the engine that long).
    Applies to queues made after the call (vLLM makes them at engine start)."""
    _, init = _spin_condition_init()
    init.__defaults__ = (busy_loop_s,)
    importlib.import_module(SHM_QUEUES).SHM_READER_RECHECK_INTERVAL_MS = int(recheck_ms)


def queue_reader_spin() -> tuple[float, int]:
    """The current (busy_loop_s default, SHM_READER_RECHECK_INTERVAL_MS) of set_queue_reader_spin."""
    _, init = _spin_condition_init()
    return init.__defaults__[0], importlib.import_module(SHM_QUEUES).SHM_READER_RECHECK_INTERVAL_MS


def keep_queue_pings(hwm: int = PING_HWM) -> None:
    """Make vLLM's shm-queue writers' wake-up pings reliable. Idempotent.

    Upstream: `shm_broadcast.SpinCondition.__init__(self, is_reader, context, notify_address,
    ...)`, whose writer branch makes a ZMQ PUB socket from `context`, sets SNDHWM=1 and binds it.
    Why: a reader that stopped spinning sleeps on a SUB socket (CONFLATE) until the writer's
    ping; a ping sent while an earlier one still counts against SNDHWM=1 (an engine step sends
    two messages, execute then sample) is dropped silently, and the reader sleeps until its
    re-check while its message waits (tests/unit/test_queue_pings.py shows it). We hand the
    writer branch a context whose sockets raise SNDHWM to `hwm`; the reader's CONFLATE still
    keeps at most one ping."""
    import zmq

    spin, init = _spin_condition_init()
    if getattr(spin.__init__, "_pdcluster_pings", False):
        return

    class PingSocket(zmq.Socket):
        def setsockopt(self, option, value):  # vLLM's writer sets SNDHWM=1 before it binds
            if option == zmq.SNDHWM:
                value = max(value, hwm)
            super().setsockopt(option, value)

    class PingContext:
        """The context vLLM's writer branch sees: its sockets are PingSockets."""

        def __init__(self, context):
            self._context = context

        def socket(self, kind, **kwargs):
            return self._context.socket(kind, socket_class=PingSocket, **kwargs)

        def __getattr__(self, name):
            return getattr(self._context, name)

    original = spin.__init__

    @functools.wraps(original)
    def wrapped(self, is_reader, context, notify_address, *args, **kwargs):
        if not is_reader:
            context = PingContext(context)
        original(self, is_reader, context, notify_address, *args, **kwargs)

    wrapped._pdcluster_pings = True  # type: ignore[attr-defined]
    spin.__init__ = wrapped


def queue_pings_kept() -> bool:
    """Whether keep_queue_pings is in effect in this process."""
    spin, _ = _spin_condition_init()
    return bool(getattr(spin.__init__, "_pdcluster_pings", False))
