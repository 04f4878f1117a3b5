"""The P/D handoff: one client request through its phases, and the one way the router recovers
when a replica fails a phase.

Disaggregated mode:
  1. choose (and hold) the decode replica first: with none ready the request fails at once (503)
     and no prefill computes KV that nobody would pull;
  2. prefill: POST a copy with max_tokens=1, stream=false and kv_transfer_params asking for a
     remote decode to a prefill replica; a prefill error goes straight back to the client;
  3. decode: POST the original request plus the returned kv_transfer_params to the chosen decode
     replica and relay its answer (SSE stream or JSON). Streaming requests that allow it get the
     prefill's first token at once, and the decode replica continues after it (continuation.py);
     with router.decode_ahead that continuation leaves with the prefill request and finds its
     lease by key (`Ahead`), and is dropped for the one sent after the prefill when the prefill's
     answer does not match what it assumed.
Requests for several choices (`n` > 1) skip the prefill: the decode replica computes the prompt
once and its children share it (vLLM's parallel sampling over its own prefix cache); one lease
would be used up by the first child's pull. Aggregated mode sends the request to one replica.

Recovery (`PhaseRunner.recover`), the same for every phase and role:
  - a replica never reached (nothing was sent): the same phase on another replica of its role;
    for decode the lease on the producer is intact, so the same kv_transfer_params go to another
    decode replica, without a second prefill;
  - a replica reached that then failed before any byte went to the client: it is excluded and
    the request goes again from its first phase (for decode: a fresh prefill, so a fresh lease,
    for another decode replica; the failed one may have used up the lease);
  - a decode stream that broke after its answer began: it moves to another decode replica
    (migration.py), continued after the tokens the client has, or started over when decode
    computed the request alone and nothing reached the client; else an SSE error event;
  - each role gets `phase_attempts` replicas per request; past that, or when no untried replica
    of the role is ready, a 503 naming the role and the replicas tried.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import Response

from pdcluster.errors import NoReplicaError, PDClusterError, ReplicaError
from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.params import KVParams
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.policies import ReplicaLoad
from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router import continuation, migration
from pdcluster.orchestrator.router.ahead import Ahead, Vouchers, lease_lost
from pdcluster.orchestrator.router.bodies import answer_body, prefill_body
from pdcluster.orchestrator.router.cache_index import Prompt
from pdcluster.orchestrator.router.pool import ReplicaPool, exhausted
from pdcluster.orchestrator.router.relay import (
    Relay,
    RelayResponse,
    TokenClock,
    closing,
    error_event,
    first_event,
    has_token,
    mid_stream_error,
    upstream_error_event,
    whole_stream,
)
from pdcluster.orchestrator.router.requests import error_response, prompt_count
from pdcluster.orchestrator.router.settings import ENDPOINTS, RouterSettings
from pdcluster.orchestrator.router.upstream import PhaseFailed, ReachedThenFailed, outcome_for, post

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Handoff:
    """One client request on its way through the phases: what it asked, which replicas it holds
    and has tried, the lease it carries, and how it ended."""

    body: dict[str, Any]
    kind: str
    started: float
    pool: ReplicaPool
    metrics: RouterMetrics
    tokens: int = 0  # prompt tokens, counted or estimated (load balancing)
    prompt: Prompt | None = None  # token ids and block hashes (cache-aware routing)
    cached: dict[str, int] = field(default_factory=dict)  # replica -> prompt tokens its cache held when chosen
    continuing: bool = False  # may take its first token from the prefill (continuation.py)
    local: bool = False  # decode computes the prompt itself (several choices or prompts): no prefill
    ahead_dropped: bool = False  # a continuation sent ahead was dropped: none is sent again
    deadline: float = float("inf")  # perf_counter() time the whole request must end by
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # sent as X-Request-Id
    client_request_id: str = ""  # the client's X-Request-Id (or body request_id): every pass's id
    prefill: ReplicaLoad | None = None  # the prefill replica of the latest pass
    answering: ReplicaLoad | None = None  # the replica whose answer the client gets (decode/aggregated)
    excluded: dict[str, list[str]] = field(default_factory=dict)  # role -> replicas that failed it
    params: dict[str, Any] | None = None  # kv_transfer_params of the current lease
    prefilled_at: float = 0.0  # perf_counter() when the prefill answered with that lease (token 1 computed)
    first: continuation.FirstToken | None = None  # the prefill's first token, if decode continues
    ahead: Ahead | None = None  # the continuation sent with the prefill, once the prefill matched it
    delivered: bool = False  # bytes went to the client
    route: str | None = None  # its path once decided (PhaseRunner._route), counted when its phases end
    first_source: str | None = None  # role whose first token the client gets: its last prefill pass says
    outcome: str = "ok"
    _held: list[tuple[ReplicaLoad, int]] = field(default_factory=list)  # with the tokens each holds
    _finished: bool = False

    @property
    def path(self) -> str:
        return ENDPOINTS[self.kind]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def choose(self, role: str) -> ReplicaLoad:
        """A ready replica of `role` that has not failed this request, held for it (NoReplicaError
        if there is none). What its cache holds of the prompt is noted (`cached`) before the
        prompt joins its history; a prefill or aggregated replica holds the tokens it computes."""
        replica = self.pool.choose(role, self.excluded.get(role, ()), self.prompt)
        cached = self.cached[replica.replica_id] = self.pool.cache.cached_tokens(replica.replica_id, self.prompt)
        tokens = self.tokens - cached if role != "decode" else self.tokens
        self.pool.enter(replica, tokens)
        self._held.append((replica, tokens))
        self.pool.cache.sent(replica.replica_id, self.prompt)
        return replica

    def drop(self, replica: ReplicaLoad) -> None:
        """This request no longer needs `replica` (a no-op if it does not hold it)."""
        for i, (held, tokens) in enumerate(self._held):
            if held is replica:
                del self._held[i]
                self.pool.leave(replica, tokens)
                return

    def release(self) -> None:
        """Drop every replica still held (the request ended, whichever way)."""
        while self._held:
            self.pool.leave(*self._held.pop())

    def finish(self, outcome: str | None = None, e2e: bool = True) -> None:
        """Record how the request ended, once (the first call wins); `e2e`: observe its latency."""
        if self._finished:
            return
        self._finished = True
        if outcome is not None:
            self.outcome = outcome
        if e2e:
            self.metrics.e2e.observe(time.perf_counter() - self.started)
        self.metrics.requests.labels(self.kind, self.outcome).inc()

    def served_by(self) -> dict[str, str]:
        """Response headers naming the replicas (X-PDCluster-Prefill, -Decode, -Aggregated)."""
        headers = {}
        for replica in (self.prefill, self.answering):
            if replica is not None:
                headers[f"X-PDCluster-{replica.role.capitalize()}"] = replica.replica_id
        return headers


class PhaseRunner:
    """Runs requests through their phases against the pool, with the one recovery strategy."""

    def __init__(self, settings: RouterSettings, pool: ReplicaPool, metrics: RouterMetrics):
        self.settings, self.pool, self.metrics = settings, pool, metrics
        self.http: httpx.AsyncClient | None = None  # the router's client, set when it starts
        self._faults = random.Random(0)
        self._vouchers = Vouchers()  # router.decode_ahead (ahead.py)

    def wants_prompt_ids(self, h: Handoff) -> bool:
        """Does this request's path need its prompt's token ids (a continuation sent ahead)?"""
        return self.settings.decode_ahead and h.continuing and not h.ahead_dropped

    def handoff(self, body: dict[str, Any], kind: str, started: float) -> Handoff:
        continuing = (
            self.settings.disaggregated
            and self.settings.first_token_from_prefill
            and continuation.continuable(body, kind, self.settings.generation_defaults, self.settings.max_model_len)
        )
        # Decode computes the prompt itself for several choices or prompts (one lease serves one
        # pull, and vLLM answers a batch of prompts with the first one's lease only), and when no
        # prefill replica is ready (scaled to 0, or all dead): served, not refused.
        several = (body.get("n") or 1) > 1 or prompt_count(body, kind) > 1
        local = self.settings.disaggregated and (several or not self._prefill_ready())
        deadline = started + self.settings.request_timeout_s
        return Handoff(
            body,
            kind,
            started,
            self.pool,
            self.metrics,
            continuing=continuing and not local,
            local=local,
            deadline=deadline,
        )

    def _prefill_ready(self) -> bool:
        return self.pool.ready_roles().get("prefill", 0) > 0

    async def serve(self, h: Handoff) -> Response:
        """The client's response. A streamed one owns the request's holds from here on (Relay);
        for any other answer, or an exception, they end here."""
        try:
            response = await self._run(h)
        except BaseException:
            h.release()
            raise
        finally:
            if h.route is not None:  # counted once, as the path it ended on
                self.metrics.routes.labels(h.route).inc()
            if h.first_source is not None:  # once, however many prefill passes it took
                self.metrics.first_token_source.labels(h.first_source).inc()
        if not isinstance(response, RelayResponse):
            h.release()
        return response

    async def _run(self, h: Handoff) -> Response:
        answering_role = "decode" if self.settings.disaggregated else "aggregated"
        while True:
            try:
                if h.answering is None:
                    h.answering = h.choose(answering_role)
                    self._route(h)
                needs_prefill = self.settings.disaggregated and not h.local and h.params is None
                if needs_prefill and (early := await self._prefill_or_alone(h)) is not None:
                    return early
                if needs_prefill and not h.local and h.params is None:
                    continue  # its lease went with a continuation sent ahead and dropped
                if h.answering.state == ReplicaState.DEAD and h.ahead is None:
                    # Found dead while the prefill ran: a post to it would wait out the connect
                    # timeout (a host cut off) and spend one of the role's attempts.
                    h.drop(h.answering)
                    h.answering = h.choose(answering_role)
                if h.first is not None:
                    return self._continuation(h)
                return await self._deliver(h)
            except PhaseFailed as failure:
                self.recover(h, failure)

    def _route(self, h: Handoff) -> None:
        """Decide a disaggregated request's path once its decode replica is chosen (counted by serve):
        `pd` (prefill, then decode pulls the KV), `decode` (decode computes the prompt: several
        choices or prompts, or no prefill ready), `local_prefill` (conditional disaggregation: the
        decode replica holds all but at most router.local_prefill_max_tokens of the prompt, or the
        prompt is that short: it computes the rest itself, no prefill hop, no transfer), or
        `local_queue` (the same for at most router.local_prefill_queue_tokens tokens to compute
        while every ready prefill replica has that many in flight: it would queue there longer
        than decode takes to compute it, and no longer prompt stalls decode's streams this way)."""
        if not self.settings.disaggregated or h.route is not None:
            return
        assert h.answering is not None
        limit, queue = self.settings.local_prefill_max_tokens, self.settings.local_prefill_queue_tokens
        compute = h.tokens - h.cached.get(h.answering.replica_id, 0)
        short = limit > 0 and compute <= limit
        queued = not short and queue > 0 and compute <= queue and self.pool.prefill_queue() >= queue
        if not h.local and (short or queued):
            h.local, h.continuing = True, False
            h.route = "local_prefill" if short else "local_queue"
            return
        h.route = "decode" if h.local else "pd"

    def recover(self, h: Handoff, failure: PhaseFailed) -> None:
        """Make `h` ready for its next try after `failure`, or raise what ends the request (see
        the module docstring): the failed replica is let go and not chosen again for this request;
        a reached one after bytes went to the client ends the stream; each role may fail the
        request `phase_attempts` times."""
        replica = failure.replica
        h.drop(replica)
        if replica is h.answering:
            h.answering = None
        reached = isinstance(failure, ReachedThenFailed)
        if reached and h.delivered:
            raise ReplicaError(mid_stream_error(replica.replica_id, failure.cause)) from failure
        excluded = h.excluded.setdefault(replica.role, [])
        excluded.append(replica.replica_id)
        if len(excluded) >= self.settings.phase_attempts:
            raise NoReplicaError(exhausted(replica.role, excluded)) from failure
        self.metrics.retries.labels(replica.role).inc()
        if reached and replica.role == "decode":
            h.params = h.first = h.ahead = None  # the lease may be used up: prefill again for a fresh one

    async def _prefill_or_alone(self, h: Handoff) -> Response | None:
        """The prefill pass; when the last prefill replica left meanwhile, decode computes the
        prompt itself instead (a request that failed on every prefill replica still ends)."""
        try:
            return await self._prefill(h)
        except NoReplicaError:
            if self._prefill_ready():
                raise  # ready replicas that all failed this request: it ends with the 503
            h.local, h.continuing, h.route = True, False, "decode"
            return None

    async def _prefill(self, h: Handoff) -> Response | None:
        """One prefill pass: a fresh lease in `h.params` (and `h.first` when the decode replica
        may continue after the prefill's token), or the response that ends the request here."""
        assert self.http is not None
        prefill = h.prefill = h.choose("prefill")
        h.request_id = h.client_request_id or uuid.uuid4().hex
        ahead = self._send_ahead(h, prefill)
        started = time.perf_counter()
        try:
            body = prefill_body(h.body, h.kind, h.continuing, ahead.key if ahead else None)
            response = await post(self.http, prefill, h.path, body, False, h.request_id)
            return self._prefilled(h, prefill, response, started, ahead)
        finally:
            h.drop(prefill)
            if ahead is not None:
                self.metrics.decode_ahead.labels("streamed" if h.ahead is ahead else "dropped").inc()
                if h.ahead is not ahead:
                    ahead.drop()

    def _send_ahead(self, h: Handoff, prefill: ReplicaLoad) -> Ahead | None:
        """The continuation sent now, with the prefill request, where it can be (ahead.py)."""
        if not self.wants_prompt_ids(h):
            return None
        assert self.http is not None
        deadline = time.time() + max(0.0, h.deadline - time.perf_counter())
        ids = h.prompt.ids if h.prompt is not None else None
        if ids is not None and not continuation.room_after(len(ids) + 1, self.settings.max_model_len):
            return None
        s = self.settings
        body = functools.partial(
            continuation.ahead_body, h.body, h.kind, ids, defaults=s.generation_defaults, max_model_len=s.max_model_len
        )
        return self._vouchers.send(self.http, prefill, h.answering, h.request_id, body, ids, deadline)

    def _prefilled(
        self, h: Handoff, prefill: ReplicaLoad, response: httpx.Response, started: float, ahead: Ahead | None
    ) -> Response | None:
        elapsed = time.perf_counter() - started
        self.metrics.prefill.observe(elapsed)
        self.metrics.window(prefill.replica_id).phase.add(elapsed)
        self.metrics.cluster.phase.add(elapsed)
        if response.status_code != 200:
            h.finish(outcome_for(response.status_code), e2e=False)
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        try:
            answer = response.json()
            stop = continuation.stopped(answer, h.kind, h.body) if h.continuing else None
            if stop is None:
                lease = KVParams.from_dict(answer.get("kv_transfer_params"))
        except (ValueError, AttributeError) as exc:  # not JSON, not an object, or no usable lease
            raise ReplicaError(f"prefill replica {prefill.replica_id} returned an unusable answer: {exc}") from None
        if stop is not None:  # it stopped at token 1: the client's whole answer, decode not asked
            h.answering = None  # its hold ends with the request's (serve)
            h.first_source = "prefill"
            return whole_stream(h, TokenClock(self.metrics, prefill.replica_id, h.started), stop)
        if self._faults.random() < self.settings.abandon_after_prefill_rate:
            # Injected fault: the client is gone between phases; nobody pulls this KV.
            h.finish("abandoned", e2e=False)
            return error_response(503, "injected fault: request abandoned after prefill", "fault_injection")
        # What the decode request carries: the lease, and the prefill's own prefix-cache hit,
        # which vLLM adds for decode to report as the request's cached tokens (not its own ~100 %)
        h.params = lease.to_dict() | kvp.prefill_cache_hit(answer.get("kv_transfer_params"))
        h.prefilled_at = time.perf_counter()
        h.first = continuation.first_token(answer, h.kind, lease) if h.continuing else None
        if h.first is not None and not continuation.room_after(
            len(h.first.prompt_ids) + 1, self.settings.max_model_len
        ):
            h.first = None  # token 1 fills the context: the classic path answers it
        self._vouchers.learn(prefill.replica_id, lease)
        if ahead is not None and ahead.matches(h.first, lease):
            h.ahead = ahead
        elif ahead is not None:
            # Filed under the dropped continuation's key, this lease may be pulled and released by
            # now (its decode engine looks it up as it is filed): prefilled again, for a fresh one
            # (a prefix-cache hit on the prefill), without a continuation ahead.
            h.params, h.first, h.ahead_dropped = None, None, True
            return None
        h.first_source = "prefill" if h.first is not None else "decode"
        return None

    async def _deliver(self, h: Handoff) -> Response:
        """Send the request to the replica that answers it and relay the answer (stream or JSON)."""
        assert self.http is not None and h.answering is not None
        replica = h.answering
        progress = self._progress(h)
        body = answer_body(h.body, h.params, tracked=progress is not None)
        upstream = await post(self.http, replica, h.path, body, h.stream, h.request_id)
        headers = h.served_by()
        if not h.stream:
            h.drop(replica)
            h.finish(outcome_for(upstream.status_code, upstream.content))
            if upstream.status_code == 200 and h.params is not None:  # P/D: token 1 when the prefill answered
                self.metrics.whole_answer(h.prefilled_at - h.started, h.prefilled_at, upstream.content)
            return Response(
                upstream.content, status_code=upstream.status_code, media_type="application/json", headers=headers
            )
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            h.finish(outcome_for(upstream.status_code, content), e2e=False)
            return Response(content, status_code=upstream.status_code, media_type="application/json", headers=headers)
        relay = Relay(h, upstream)
        clock = TokenClock(self.metrics, replica.replica_id, h.started)
        return RelayResponse(
            closing(relay, migration.relayed(self, h, relay, upstream, clock, None, progress)), relay, headers
        )

    def _progress(self, h: Handoff) -> migration.Progress | None:
        """A decode stream that may migrate mid-stream gets its progress tracked (migration.py)."""
        if not (self.settings.disaggregated and self.settings.migration_limit > 0):
            return None
        s = self.settings
        return migration.progress_for(h.body, h.kind, s.generation_defaults, h.first, h.params is None, s.max_model_len)

    def _continuation(self, h: Handoff) -> Response:
        """Stream the prefill's first token now; the decode replica's continuation follows. The
        continuation request leaves at once and travels while the client reads the first token."""
        assert h.first is not None and h.params is not None
        relay = Relay(h)
        s = self.settings
        body = continuation.decode_body(h.body, h.kind, h.first, h.params, s.generation_defaults, s.max_model_len)
        if h.ahead is not None:
            relay.pending = h.ahead.pending  # already on its way; `body` only if it fails
        else:
            self._dispatch(h, relay, body)
        return RelayResponse(closing(relay, self._continue(h, relay, body)), relay, h.served_by())

    def _dispatch(self, h: Handoff, relay: Relay, body: dict[str, Any]) -> None:
        """Send the continuation to the decode replica (chosen now if there is none) without
        waiting; the relay owns the request from here."""
        assert self.http is not None
        if h.answering is None:
            h.answering = h.choose("decode")
        relay.pending = asyncio.ensure_future(
            post(self.http, h.answering, continuation.CONTINUATION_PATH, body, True, h.request_id)
        )

    async def _continue(self, h: Handoff, relay: Relay, body: dict[str, Any]) -> AsyncIterator[bytes]:
        assert h.first is not None and h.answering is not None and relay.pending is not None
        prelude = continuation.prelude(h.first, h.kind, h.body)
        first_tokens = sum(map(has_token, prelude))
        clock = TokenClock(self.metrics, h.answering.replica_id, h.started, handoff=first_tokens > 0)
        try:
            clock.tokens(first_tokens)
            yield "".join(f"data: {json.dumps(event)}\n\n" for event in prelude).encode()
            h.delivered = True
            progress = self._progress(h)
            ahead = h.ahead is not None
            chunks = None
            while True:
                try:
                    # Shielded: a client gone cancels this task again each turn of the loop
                    # (anyio's cancel scope), and each cancel reached the request awaited,
                    # breaking off httpcore's close of its connection: the decode engine
                    # generated on for nobody. relay.close() cancels it once instead.
                    upstream = await asyncio.shield(relay.pending)
                except PhaseFailed as failure:
                    relay.pending = None
                    ahead = False
                    if isinstance(failure, ReachedThenFailed) and progress is not None and progress.can_resume:
                        # it may have used up the lease: continue elsewhere from the first token
                        async for chunk in migration.relayed(
                            self, h, relay, None, clock, None, progress, failure.cause
                        ):
                            yield chunk
                        return
                    self.recover(h, failure)
                    self._dispatch(h, relay, body)
                    continue
                relay.upstream = upstream
                if not ahead or upstream.status_code != 200:
                    break
                first, chunks = await first_event(upstream)
                if not lease_lost(first):
                    break
                # The decode engine gave up on the lease before its first token (ahead.py): the
                # continuation after the prefill's token goes instead; the lease is still there.
                await upstream.aclose()
                relay.upstream, chunks, ahead = None, None, False
                self.metrics.decode_ahead.labels("lost").inc()
                self._dispatch(h, relay, body)
            if upstream.status_code != 200:
                raw = await upstream.aread()
                h.outcome = outcome_for(upstream.status_code, raw)
                yield upstream_error_event(raw, upstream.status_code)
                return
            rewrite = functools.partial(continuation.rewrite, kind=h.kind, first=h.first, ahead=ahead)
            async for chunk in migration.relayed(self, h, relay, upstream, clock, rewrite, progress, chunks=chunks):
                yield chunk
        except httpx.HTTPError as exc:  # the decode replica's answer did not come (a timeout)
            h.outcome = "upstream_error"
            yield error_event(
                mid_stream_error(h.answering.replica_id if h.answering else "decode", exc), "upstream_error", 502
            )
        except PDClusterError as exc:
            h.outcome = "no_replica" if isinstance(exc, NoReplicaError) else "upstream_error"
            yield error_event(str(exc), exc.error_type, exc.http_status)
