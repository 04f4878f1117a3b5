"""Consumer: requests admitted ahead of their prefill (router.decode_ahead) find their lease.

The scheduler admits such a request at once and plans its pull without a lease (`PullSpec`
with `awaiting`: the router's key, a lease the same producer signed earlier as the voucher of
its endpoints, a deadline). Here, one lookup thread per producer asks it for the leases of the
requests awaiting it, by key (`Handouts`), until each is found or its deadline passes. The
producer holds the call while none of its leases is in and answers the moment one is filed; a
request that starts awaiting the same producer cancels the held call, which is asked again with
its key too. So a lookup costs a call per request and per lease found, not a call per interval:

- found: the lease must verify (signed by a producer of this cluster) and carry the prefill's
  first token. The token is recorded for the scheduler (`take_first_tokens`, sent as worker
  metadata) *before* the pull is submitted, so a load vLLM hears of has had its token sent in
  the same step's metadata or an earlier one; the scheduler makes it the last prompt token.
- never found (the prefill failed, the producer is unreachable, the deadline passed): the
  request has no first token and must not be computed, so its load is not reported. The
  engine's API process is asked to abort it (failures.report_failure with the request id); once
  the scheduler says it ended (`abandon`), its load is reported as failed, which frees its blocks
  (vLLM frees a request's blocks only once its load is reported).
- ended before its lease was found (`abandon`; or before its blocks were allocated: `forsake`):
  its prefill may still file a lease under its key. The key stays looked up, until its deadline,
  and a lease that comes is released at once (not held by the producer until it expires).
- none comes (the producer hands out an empty lease for the key): the prefill stopped at its
  first token, and the router answers the request from the prefill's answer. The lookup ends; a
  request still here is aborted (the router ends it too), without an error.

A request is looked up from its arrival (`queue`), not only once its blocks are allocated (`add`):
one that queues for blocks longer than the producer's lease lasts would find it expired. A lease
found while its request queues is held (renewed, lease_messages.py) until the pull is planned,
which then starts at once, or released when the request ends in the queue.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pdcluster.errors import KVTransferError, UntrustedParamsError
from pdcluster.kv_transfer.failures import report_failure
from pdcluster.kv_transfer.metadata import PullSpec
from pdcluster.kv_transfer.params import KVParams

logger = logging.getLogger(__name__)

LOOKUP_HOLD_S = 1.0  # how long a producer may hold a lookup (producer.HANDOUT_WAIT_CAP_S)
# A producer whose held lookups are all taken answers at once, with nothing: asked again after
# this (producers before HANDOUT_WAIT_CAP_S was raised hold at most 50 ms; they are asked again
# when that ends).
LOOKUP_RETRY_S = 0.02


class AheadPulls:
    def __init__(
        self,
        *,
        engine_id: str,
        params_key: bytes,
        timeout_s: float,
        endpoint_for: Callable[[KVParams], str],
        connection: Callable[[str], Any],
        submit_pull: Callable[[PullSpec], None],
        report_failed: Callable[[str, str, str], None],
        release: Callable[[KVParams], None],
        hold: Callable[[KVParams], None],
    ):
        self.engine_id = engine_id
        self._params_key = params_key
        self._timeout_s = timeout_s
        self._endpoint_for = endpoint_for  # verifies the voucher (raises KVTransferError)
        self._connection = connection  # a gRPC client of an endpoint
        self._submit_pull = submit_pull
        self._report_failed = report_failed  # (request id, error, cause): a failed load for vLLM
        self._release = release  # an unpulled lease back to its producer (no answer awaited)
        self._hold = hold  # renew a lease until it is pulled or released
        self._lock = threading.Lock()
        self._awaiting: dict[str, tuple[str, PullSpec]] = {}  # request id -> (endpoint, pull)
        self._queued: dict[str, tuple[str, PullSpec]] = {}  # arrived, no pull planned yet: looked up
        self._held: dict[str, tuple[KVParams, int]] = {}  # found while queued: lease (renewed), token
        self._queued_given_up: set[str] = set()  # aborted while queued: a pull planned later fails
        self._forsaken: dict[str, tuple[str, PullSpec]] = {}  # ended: its lease released if it comes
        self._given_up: set[str] = set()  # never found: load unreported until abandoned
        self._first_tokens: dict[str, int] = {}  # found, not yet told to the scheduler
        self._lookups: set[str] = set()  # endpoints with a lookup thread running
        self._changed: dict[str, threading.Event] = {}  # endpoint -> a key joined its lookup
        self._closed = threading.Event()

    def queue(self, spec: PullSpec) -> None:
        """A request admitted ahead arrived (no blocks yet): look its lease up now."""
        assert spec.awaiting is not None
        try:
            endpoint = self._endpoint_for(spec.awaiting.voucher)
        except KVTransferError:
            return  # its pull, once planned, fails with the reason (`add`)
        with self._lock:
            if self._closed.is_set():
                return
            self._queued[spec.request_id] = (endpoint, spec)
        self._watch(endpoint)

    def add(self, spec: PullSpec) -> None:
        """Its blocks are allocated: pull once the lease is in (at once if it was found already)."""
        assert spec.awaiting is not None
        rid = spec.request_id
        try:
            endpoint = self._endpoint_for(spec.awaiting.voucher)  # only what a producer vouched for
        except KVTransferError as exc:
            with self._lock:
                self._given_up.add(rid)
                self._queued.pop(rid, None)
            # off the engine's step: an abort report waits for room in a full inbox (failures.py)
            threading.Thread(target=self._abort, args=(spec, str(exc)), name="kv-abort", daemon=True).start()
            return
        with self._lock:
            looked_up = self._queued.pop(rid, None) is not None  # its key is in its lookup already
            held = self._held.pop(rid, None)
            if rid in self._queued_given_up:  # aborted while queued: its load fails once it ends
                self._queued_given_up.discard(rid)
                self._given_up.add(rid)
                return
            if held is not None:
                self._first_tokens[rid] = held[1]
            else:
                self._awaiting[rid] = (endpoint, spec)
        if held is not None:
            self._pull(spec, held[0])
        elif not looked_up:
            self._watch(endpoint)

    def forsake(self, spec: PullSpec) -> None:
        """A request admitted ahead ended before its blocks were allocated: release its lease if
        its prefill still files one."""
        assert spec.awaiting is not None
        try:
            endpoint = self._endpoint_for(spec.awaiting.voucher)
        except KVTransferError:
            return  # nothing this consumer would dial
        with self._lock:
            self._queued_given_up.discard(spec.request_id)
            self._queued.pop(spec.request_id, None)
            held = self._held.pop(spec.request_id, None)
            if held is None:
                if self._closed.is_set():
                    return
                self._forsaken[spec.request_id] = (endpoint, spec)
        if held is not None:
            self._release(held[0])  # found while it queued: its producer may free the blocks now
            return
        self._watch(endpoint)

    def _watch(self, endpoint: str) -> None:
        """Make the endpoint's lookup ask with the keys just added (starting it if none runs)."""
        with self._lock:
            changed = self._changed.setdefault(endpoint, threading.Event())
            if endpoint in self._lookups:
                changed.set()  # the running lookup asks again, with the new key
                return
            self._lookups.add(endpoint)
        # A thread per producer awaited, for as long as a request awaits it: a lookup holds its
        # thread while its producer holds the call, so a bounded pool would leave the requests
        # of the producers beyond it unlooked-up (and past their deadlines) while others wait.
        name = f"kv-lease-lookup-{endpoint}"
        threading.Thread(target=self._look_up, args=(endpoint, changed), name=name, daemon=True).start()

    def take_first_tokens(self) -> dict[str, int]:
        with self._lock:
            tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def abandon(self, request_id: str) -> None:
        """The scheduler says an awaiting request ended: stop looking, and report its load (a
        request whose lease was found reports through its pull instead)."""
        with self._lock:
            held = self._held.pop(request_id, None)  # its pull was never planned (vLLM declined the load)
            self._queued.pop(request_id, None)
            self._queued_given_up.discard(request_id)
            entry = self._awaiting.pop(request_id, None)
            awaited = entry is not None
            if awaited and not self._closed.is_set():
                self._forsaken[request_id] = entry  # still looked up: its lease released if it comes
            given_up = request_id in self._given_up
            self._given_up.discard(request_id)
        if awaited:  # (one given up was logged then)
            logger.info("request %s admitted ahead of its prefill ended before its lease came", request_id)
        if held is not None:
            self._release(held[0])
        if awaited or given_up:
            self._report_failed(request_id, "the request ended before its prefill's lease came", "abandoned")

    def shutdown(self) -> None:
        with self._lock:
            self._awaiting.clear()  # lookup threads end at their next turn
            self._forsaken.clear()
            self._queued.clear()
            self._held.clear()
            self._closed.set()
            for changed in self._changed.values():
                changed.set()  # held lookups are cancelled

    # -- lookup threads ------------------------------------------------------------------------

    def _look_up(self, endpoint: str, changed: threading.Event) -> None:
        """Ask one producer for the leases of the requests awaiting it, until none awaits."""
        while True:
            with self._lock:
                changed.clear()  # before reading the keys: a key added after this cancels the call
                waiting = {
                    spec.awaiting.key: spec
                    for ep, spec in (*self._awaiting.values(), *self._queued.values())
                    if ep == endpoint
                }
                forsaken = {spec.awaiting.key: spec for ep, spec in self._forsaken.values() if ep == endpoint}
                if not waiting and not forsaken:
                    self._lookups.discard(endpoint)
                    return
            now = time.time()
            for key, spec in list(waiting.items()):
                if now > spec.awaiting.deadline:
                    del waiting[key]
                    self._give_up(spec, "its prefill's lease did not come before the request's deadline")
            for key, spec in list(forsaken.items()):
                if now > spec.awaiting.deadline:  # no lease came while its request could have used it
                    del forsaken[key]
                    with self._lock:
                        self._forsaken.pop(spec.request_id, None)
            waiting.update(forsaken)
            if not waiting:
                continue
            hold = min(LOOKUP_HOLD_S, min(spec.awaiting.deadline for spec in waiting.values()) - now)
            asked = time.monotonic()
            try:
                found = self._connection(endpoint).handouts(
                    list(waiting), engine_id=self.engine_id, wait_s=hold, timeout_s=self._timeout_s, interrupt=changed
                )
            except Exception as exc:  # noqa: BLE001 - runs on a lookup thread: nothing may escape unseen
                for spec in waiting.values():
                    self._give_up(spec, f"looking its lease up on {endpoint} failed: {type(exc).__name__}: {exc}")
                with self._lock:
                    for spec in forsaken.values():  # an unreachable producer holds its leases to expiry
                        self._forsaken.pop(spec.request_id, None)
                continue
            if found is None:
                continue  # cancelled: another key joined
            for key, (params, token) in found.items():
                if key in waiting:
                    self._found(waiting[key], params, token)
            if not found and time.monotonic() - asked < hold / 2:
                self._closed.wait(LOOKUP_RETRY_S)  # answered without a hold: ask again shortly

    def _found(self, spec: PullSpec, params_json: str, token: int) -> None:
        """A lease came for an awaiting request: its first token to the scheduler, then its pull
        (for one that ended meanwhile: released)."""
        with self._lock:
            self._forsaken.pop(spec.request_id, None)  # asked for once
        if not params_json:
            self._give_up(spec, "its prefill stopped at its first token: the router answers it", expected=True)
            return
        try:
            lease = KVParams.from_dict(json.loads(params_json))
            if not lease.verify(self._params_key):
                raise UntrustedParamsError(f"the lease handed out for {spec.request_id} is not signed by this cluster")
            if token < 0:
                raise KVTransferError(f"the lease handed out for {spec.request_id} carries no first token")
        except (ValueError, KVTransferError) as exc:
            self._give_up(spec, str(exc))
            return
        rid = spec.request_id
        with self._lock:
            queued = self._queued.pop(rid, None) is not None
            if queued:  # no blocks yet: held (renewed) until its pull is planned (`add`)
                self._held[rid] = (lease, token)
                self._hold(lease)
                return
            entry = self._awaiting.pop(rid, None)
            if entry is not None:
                self._first_tokens[rid] = token
        if entry is None:  # ended meanwhile: its producer may free the blocks now, not at expiry
            self._release(lease)
            return
        self._pull(entry[1], lease)  # the planned pull's spec (one found while queued is the arrival's)

    def _pull(self, spec: PullSpec, lease: KVParams) -> None:
        """Submit the pull of `lease` into the blocks `spec` planned (its first token is told)."""
        offset, count = spec.remote_offset, len(spec.local_block_ids)
        remote = lease.remote_block_ids[offset : offset + count]
        if lease.remote_num_tokens != spec.num_tokens:
            remote = ()  # the producer computed another prompt length: the pull fails, vLLM recomputes
        self._submit_pull(PullSpec(spec.request_id, lease, tuple(remote), spec.local_block_ids, awaiting=spec.awaiting))

    def _give_up(self, spec: PullSpec, reason: str, expected: bool = False) -> None:
        with self._lock:
            if self._awaiting.pop(spec.request_id, None) is not None:
                self._given_up.add(spec.request_id)
            elif self._queued.pop(spec.request_id, None) is not None:
                self._queued_given_up.add(spec.request_id)  # a pull planned before the abort lands fails
            else:
                return  # found or abandoned meanwhile
        self._abort(spec, reason, logging.INFO if expected else logging.ERROR)

    def _abort(self, spec: PullSpec, reason: str, level: int = logging.ERROR) -> None:
        assert spec.awaiting is not None
        logger.log(level, "request %s admitted ahead of its prefill: %s; aborting it", spec.request_id, reason)
        report_failure(spec.awaiting.key, spec.awaiting.voucher.remote_engine_id, reason, abort=spec.request_id)
