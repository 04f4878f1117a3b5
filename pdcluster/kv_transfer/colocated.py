"""A producer's two halves in one process: its lease filed the moment its prefill finishes.

vLLM's scheduler half learns that a prefill finished (`request_finished`, after the step that
sampled its first token) and its worker half serves the blocks. Between processes the lease can
only travel in the next step's connector metadata, which the worker binds when that step starts:
the lease, and with it decode's pull, waits for the engine to finish its output processing and
schedule again. Where the model runs in the engine core (single-process CPU engines: one worker,
the same process), the worker registers its producer here and the scheduler half files the
lease with it directly, at once; elsewhere nothing is registered and the metadata carries it.

Filing early is safe for the reason filing at bind is: the lease waits for the event recorded
after the forward that wrote its blocks (`after_forward` runs before vLLM processes that step's
output, so the worker's last step event is that forward's or a later one).
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

from pdcluster.kv_transfer.metadata import LeaseSpec


class LeaseFiler(Protocol):
    def file_leases(self, leases: list[LeaseSpec]) -> None: ...


_lock = threading.Lock()
_filers: weakref.WeakValueDictionary[str, LeaseFiler] = weakref.WeakValueDictionary()


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
