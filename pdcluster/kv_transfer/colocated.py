"""The connector's two halves in one process: leases filed at once, an engine that waits idle.

vLLM's scheduler half learns that a prefill finished (`request_finished`, after the step that
sampled its first token) and its worker half serves the blocks. Between processes the lease can
only travel in the next step's connector metadata, which the worker binds when that step starts:
the lease, and with it decode's pull, waits for the engine to finish its output processing and
schedule again. Where the model runs in the engine core (single-process CPU engines: one worker,
the same process), the worker registers its producer here and the scheduler half files the
lease with it directly, at once; elsewhere nothing is registered and the metadata carries it.

Filing early is safe for the reason filing at bind is: the lease waits for the event recorded
after the forward that wrote its blocks (`after_forward` runs before vLLM processes that step's
output, so the worker's last step event is that forward's or a later one). What already waits
for the lease (decode's handout lookup, a gRPC thread here) is woken once the engine core has
queued the step's outputs (`outputs_queued`), not while the scheduler is still building them:
on a host core it would otherwise run before the first token leaves.

The same process also runs vLLM's engine-core loop, which steps every 1 ms while its requests only
wait on the connector (compat.vllm_core_loop). With the worker here, what they wait for happens
here too: a load done or failed, a lease released or expired. Such an engine waits on its input
queue instead (`idle_wait`, up to IDLE_WAIT_CAP_S), and the worker's `EngineWaker` ends the wait
when it has something to report. A wake-up that comes before the engine first waited is kept
and delivered when it does; a missed one costs at most the cap (lease expiry is only seen at a
step, so it is seen within the cap too).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from pdcluster import compat
from pdcluster.kv_transfer.metadata import LeaseSpec

# The longest an idle engine waits without a wake-up: what bounds a missed one, a lease's expiry
# and the consumer's lease renewals (both on a scale of seconds) being seen.
IDLE_WAIT_CAP_S = 0.05


class LeaseFiler(Protocol):
    def file_leases(self, leases: list[LeaseSpec], wake: bool = True) -> None: ...

    def wake_lookups(self) -> None: ...


_lock = threading.Lock()
_filers: weakref.WeakValueDictionary[str, LeaseFiler] = weakref.WeakValueDictionary()
_due: set[LeaseFiler] = set()  # filers of leases whose waiting consumers are woken after the step
_steps_hooked = False  # this process's engine core calls `outputs_queued` after every step


def register(engine_id: str, filer: LeaseFiler) -> None:
    """The worker half of producer `engine_id` serves leases from this process."""
    with _lock:
        _filers[engine_id] = filer


def unregister(engine_id: str, filer: LeaseFiler) -> None:
    with _lock:
        if _filers.get(engine_id) is filer:
            del _filers[engine_id]


def filer_for(engine_id: str) -> LeaseFiler | None:
    """The producer of `engine_id` in this process, or None (its worker runs elsewhere)."""
    with _lock:
        return _filers.get(engine_id)


def file_lease(engine_id: str, spec: LeaseSpec) -> bool:
    """File `spec` with the producer of `engine_id` if its worker half runs in this process (False
    if not: the step's metadata carries it). Filed at once, so that a pull finds it; the consumers
    already waiting for it (decode's handout lookup, a gRPC thread of this process) are woken only
    when the step's outputs are queued (`outputs_queued`): woken here, inside the scheduler's
    output processing, that thread runs ahead of the engine thread (same process, same core), and
    the first token of this very request waits for it to answer decode."""
    filer = filer_for(engine_id)
    if filer is None:
        return False
    with _lock:
        defer = _steps_hooked
        if defer:
            _due.add(filer)  # once a step however many leases it filed
    filer.file_leases([spec], wake=not defer)
    return True


def outputs_queued() -> None:
    """The engine core queued a step's outputs (compat.wait_between_idle_steps calls this after
    every step): wake the consumers waiting for the leases that step filed."""
    global _steps_hooked
    with _lock:
        _steps_hooked = True
        due = list(_due)
        _due.clear()
    for filer in due:
        filer.wake_lookups()


class EngineWaker:
    """Ends this process's engine core's idle wait when the connector has something to report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: Any = None  # the engine core's input queue, once it first waited
        self._missed = False

    def attach(self, input_queue: Any) -> None:
        with self._lock:
            if self._queue is input_queue:
                return
            self._queue, missed, self._missed = input_queue, self._missed, False
        if missed:
            input_queue.put_nowait(compat.wakeup_item())

    def wake(self) -> None:
        with self._lock:
            target = self._queue
            if target is None:
                self._missed = True
                return
        target.put_nowait(compat.wakeup_item())


_wakers: weakref.WeakSet[EngineWaker] = weakref.WeakSet()


def register_waker(waker: EngineWaker) -> None:
    """A connector worker in this process: it wakes the engine core it shares the process with."""
    with _lock:
        _wakers.add(waker)


def unregister_waker(waker: EngineWaker) -> None:
    with _lock:
        _wakers.discard(waker)


def idle_wait(scheduler: Any, input_queue: Any) -> float | None:
    """How long the engine core may wait for its input after a step that ran no model (the hook
    of compat.wait_between_idle_steps): IDLE_WAIT_CAP_S when the connector's worker runs in this
    process (one engine's) and every request waits on it alone; else None (vLLM's 1 ms steps)."""
    with _lock:
        wakers = list(_wakers)
    if len(wakers) != 1 or not compat.only_awaiting_kv(scheduler):
        return None
    wakers[0].attach(input_queue)
    return IDLE_WAIT_CAP_S
