"""Producer-side leases: which finished prefills still hold KV blocks, and until when.

Life of a lease (one per prefill request whose KV a decode engine will pull):
  LEASED       registered by the worker when the scheduler's metadata announces it
  TRANSFERRING one or more pulls are streaming its blocks (never freed in this state)
  RELEASED     the consumer confirmed (or gave up), or the lease expired while idle
The worker reports RELEASED leases to vLLM as `finished_sending`, which frees the blocks. A pull
that arrives before the worker learned about the lease waits on a condition (bounded), never on a
sleep; a pull for a lease that already ended (expired or released) fails at once: the table
remembers the last ENDED_MEMORY ended request ids. A release that comes before its lease is
filed is kept (as many): the lease ends as it is filed. Every path ends in RELEASED:
confirmation, failed pull + release, or expiry.

A lease may also be filed under a key (a decode request admitted ahead of its prefill looks it
up by that key, never knowing the producer's request id): `handouts` answers, for a set of keys,
the signed lease and the prefill's first token of those registered so far, waiting for one to
come when none has (until its caller goes away). Ended leases keep their handout a while
(ENDED_MEMORY): a late lookup still learns the first token, and its pull then fails as for any
ended lease. A key whose prefill stopped at its first token gets no lease (the router answers the
request from the prefill): `none_comes` hands out an empty lease for it, so that its lookup ends.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.errors import LeaseExpiredError, LeaseNotFoundError

logger = logging.getLogger(__name__)

ENDED_MEMORY = 65536  # ended leases remembered, so a late pull fails at once instead of waiting


class LeaseState(enum.IntEnum):
    LEASED = 1
    TRANSFERRING = 2
    RELEASED = 3


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # time.monotonic() domain
    ready_event: Any = None  # device event after the forward that wrote the blocks (None on CPU)
    state: LeaseState = LeaseState.LEASED
    active_pulls: int = 0
    release_requested: bool = False
    expired: bool = False
    transferred: bool = False
    created: float = field(default_factory=time.monotonic)
    key: str = ""
    handout: tuple[str, int] | None = None  # with a key: (signed lease as JSON, first token)


class LeaseTable:
    def __init__(self, on_finished: Callable[[], None] | None = None) -> None:
        # called (under the table's lock: it must not block) when a lease is released, so that
        # an engine waiting idle steps and reports it (colocated.EngineWaker)
        self._on_finished = on_finished
        self._leases: dict[str, Lease] = {}
        self._finished: list[Lease] = []
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> how its lease ended
        self._by_key: dict[str, Lease] = {}
        self._ended_handouts: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> handout
        # Released before it was filed (its worker hears of a lease a step after the scheduler
        # signed it, where they are apart): request id -> transferred; it ends once filed.
        self._released_early: OrderedDict[str, bool] = OrderedDict()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return sum(1 for lease in self._leases.values() if lease.state != LeaseState.RELEASED)

    def add(
        self,
        request_id: str,
        block_ids: Sequence[int],
        deadline: float,
        ready_event=None,
        key: str = "",
        handout: tuple[str, int] | None = None,
        wake: bool = True,
    ):
        """Hold `block_ids` for a consumer until `deadline`. `wake` False: the pulls and lookups
        waiting for it are left waiting until the caller's `wake()` (colocated.py: after the step's
        outputs left, so that they do not take the process's turn from the first token)."""
        with self._cond:
            if request_id in self._leases:
                logger.warning("lease for %s registered twice; keeping the first", request_id)
                return
            lease = Lease(request_id, tuple(block_ids), deadline, ready_event, key=key, handout=handout)
            self._leases[request_id] = lease
            if key and handout is not None:
                self._by_key[key] = lease
            if request_id in self._released_early:
                lease.release_requested, lease.transferred = True, self._released_early.pop(request_id)
                self._finish(lease)
            if wake:
                self._cond.notify_all()

    def none_comes(self, key: str, first_token: int, wake: bool = True) -> None:
        """No lease will be filed under `key`: its lookups are answered ("", first_token)."""
        with self._cond:
            self._ended_handouts[key] = ("", first_token)
            while len(self._ended_handouts) > ENDED_MEMORY:
                self._ended_handouts.popitem(last=False)
            if wake:
                self._cond.notify_all()

    def handouts(
        self, keys: Sequence[str], wait_s: float = 0.0, stop: threading.Event | None = None
    ) -> dict[str, tuple[str, int]]:
        """key -> (signed lease as JSON, first token) for the keys whose lease was registered
        (also when it already ended; "" for the lease of a key none comes for: `none_comes`);
        waits up to wait_s for one when none has yet, or until `stop` is set (and `wake` called:
        the caller went away)."""
        end = time.monotonic() + wait_s
        with self._cond:
            while True:
                found = {}
                for key in keys:
                    lease = self._by_key.get(key)
                    handout = lease.handout if lease is not None else self._ended_handouts.get(key)
                    if handout is not None:
                        found[key] = handout
                remaining = end - time.monotonic()
                if found or remaining <= 0 or (stop is not None and stop.is_set()):
                    return found
                self._cond.wait(remaining)

    def wake(self) -> None:
        """Let every waiting `handouts` and `acquire` look again (their stop event, the leases
        filed with wake=False)."""
        with self._cond:
            self._cond.notify_all()

    def acquire(self, request_id: str, block_ids: Sequence[int], wait_s: float) -> Lease:
        """Start a pull: wait up to wait_s for the lease to appear; check the requested blocks."""
        end = time.monotonic() + wait_s
        with self._cond:
            while True:
                lease = self._leases.get(request_id)
                if lease is not None:
                    break
                if request_id in self._ended:
                    raise LeaseExpiredError(f"KV lease for request {request_id} {self._ended[request_id]}")
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise LeaseNotFoundError(f"no KV lease for request {request_id} (expired, released or unknown)")
                self._cond.wait(remaining)
            if lease.state == LeaseState.RELEASED or lease.release_requested:
                raise LeaseExpiredError(f"KV lease for request {request_id} was already released")
            held = set(lease.block_ids)
            stray = [b for b in block_ids if b not in held]
            if stray:
                raise LeaseNotFoundError(f"request {request_id} does not hold blocks {stray[:4]} (holds {len(held)})")
            lease.state = LeaseState.TRANSFERRING
            lease.active_pulls += 1
            return lease

    def end_pull(self, lease: Lease) -> None:
        with self._cond:
            lease.active_pulls -= 1
            if lease.active_pulls == 0 and lease.state == LeaseState.TRANSFERRING:
                lease.state = LeaseState.LEASED
                if lease.release_requested:
                    self._finish(lease)

    def renew(self, request_ids, seconds: float) -> int:
        """Extend the leases a consumer still holds queued to `seconds` from now; how many it
        still had (ended or unknown ones are skipped)."""
        deadline = time.monotonic() + seconds
        renewed = 0
        with self._cond:
            for request_id in request_ids:
                lease = self._leases.get(request_id)
                if lease is None or lease.state == LeaseState.RELEASED or lease.release_requested:
                    continue
                lease.deadline = max(lease.deadline, deadline)
                renewed += 1
        return renewed

    def release(self, request_id: str, transferred: bool) -> bool:
        """The consumer is done with the blocks. False when the lease already ended; one not yet
        filed ends as it is filed."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None and request_id not in self._ended:
                self._released_early[request_id] = transferred
                while len(self._released_early) > ENDED_MEMORY:
                    self._released_early.popitem(last=False)
                return True
            if lease is None or lease.state == LeaseState.RELEASED or lease.release_requested:
                return False
            lease.release_requested = True
            lease.transferred = transferred
            if lease.active_pulls == 0:
                self._finish(lease)
            return True

    def _finish(self, lease: Lease) -> None:
        lease.state = LeaseState.RELEASED
        self._finished.append(lease)
        if self._on_finished is not None:
            self._on_finished()

    def collect_finished(self, now: float | None = None) -> list[Lease]:
        """Released leases plus idle ones past their deadline; each is returned exactly once."""
        now = time.monotonic() if now is None else now
        with self._cond:
            for lease in self._leases.values():
                if lease.state == LeaseState.LEASED and not lease.release_requested and now >= lease.deadline:
                    lease.expired = True
                    self._finish(lease)
            done, self._finished = self._finished, []
            for lease in done:
                del self._leases[lease.request_id]
                self._ended[lease.request_id] = "expired" if lease.expired else "was released"
                if self._by_key.pop(lease.key, None) is not None and lease.handout is not None:
                    self._ended_handouts[lease.key] = lease.handout
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)
            while len(self._ended_handouts) > ENDED_MEMORY:
                self._ended_handouts.popitem(last=False)
            return done
