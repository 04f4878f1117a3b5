"""Scheduler half of the connector (runs in the engine core, beside vLLM's scheduler).

Producer (prefill engine), per request asking for a remote decode (params.ASK_PREFILL):
  on_new_request      trims MTP's prefill backoff off the prompt (the consumer recomputes it)
  request_finished    keeps the blocks (returns True), announces a lease to the worker, and returns
                      the request's `KVParams`: engine id, endpoints, block ids, token count, expiry
                      (filed under the router's key too, with the first token, when it gave one)
Consumer (decode engine), per request carrying a producer's `KVParams`:
  on_new_request               hands its lease to the worker half, which renews it while the
                               request queues here (lease_messages.py), until its pull or release
  get_num_new_matched_tokens   the prefilled tokens beyond the local prefix-cache hit, loadable
                               asynchronously (no side effects: vLLM may ask again)
  update_state_after_alloc     plans the pull: the producer's blocks after the local hit -> the
                               request's newly allocated blocks (the hit is read off the blocks,
                               as vLLM's NIXL connector does)
  request_finished             a request dropped before its pull still releases P's lease
Consumer, per request admitted ahead of its prefill (`AwaitParams`, router.decode_ahead): its
whole prompt is claimed as an asynchronous load at once, so its blocks are allocated while the
prefill still runs; the worker finds the lease by key (from its arrival: the lease is renewed
while the request queues for blocks), reports the prefill's first token
(`update_connector_output`, which makes it the last prompt token) and pulls. The request is
never computed before that token is in: the worker reports its load only after it (metadata.py).
`build_connector_meta` hands the step's leases, queued leases, pulls and releases to the worker half.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from pdcluster import compat
from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer import colocated
from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.metadata import (
    LeaseSpec,
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PullSpec,
    ReleaseSpec,
)
from pdcluster.kv_transfer.params import AwaitParams, KVParams
from pdcluster.kv_transfer.settings import KVTransferSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_token(request: Any) -> int:
    """The token a finished prefill sampled (-1: none)."""
    return request.output_token_ids[0] if request.num_output_tokens else -1


class ConnectorScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: KVTransferSettings,
        engine_id: str,
        *,
        is_producer: bool,
        is_consumer: bool,
    ):
        self.settings = settings
        self.engine_id = engine_id
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        # MTP: the drafter reads `num_prefill_lookahead_tokens` past the computed range. With a
        # multi-module MTP chain P must stop that many tokens short (minus the one D recomputes
        # anyway) so D's draft-layer KV never holds unverified drafts (vLLM's NIXL does the same).
        self.prefill_backoff = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
        self.endpoints: list[str | None] = [None] * self.tp_size
        self._meta = PDConnectorMetadata()
        # Consumer: requests admitted ahead of their prefill, until their first token is in.
        self._awaiting: dict[str, tuple[Request, AwaitParams]] = {}
        # Producer: the params it hands out are signed (params.py); decode's worker verifies them.
        self._params_key = derive_key(settings.secret_value(), KV_PARAMS) if is_producer else b""

    # -- startup ---------------------------------------------------------------------------

    def set_worker_endpoints(self, metadata: dict[int, Any]) -> None:
        for tp_rank, meta in metadata.items():
            if isinstance(meta, PDHandshakeMetadata) and 0 <= tp_rank < self.tp_size:
                self.endpoints[tp_rank] = meta.endpoint
        if self.is_producer:
            logger.info("KV endpoints of engine %s: %s", self.engine_id, self.endpoints)

    # -- both roles ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self.is_producer and kvp.wants_remote_decode(params):
            self._truncate_for_prefill(request, params)
        if self.is_consumer and kvp.wants_remote_prefill(params):
            try:
                # kept (renewed) by the worker half until this request's pull ends or it is released
                self._meta.queued.append(KVParams.from_dict(params))
            except ValueError:
                return  # update_state_after_alloc says why, once
        elif self.is_consumer and kvp.wants_lease_await(params):
            try:
                spec = AwaitParams.from_dict(params)
            except ValueError as exc:
                logger.warning("request %s: %s; computing its prompt locally", request.request_id, exc)
                return
            self._awaiting[request.request_id] = (request, spec)
            # looked up (and its lease renewed) while it queues here: a queue longer than the
            # producer's lease would otherwise let the lease expire before the pull asks for it
            self._meta.awaited.append(PullSpec(request.request_id, None, (), (), awaiting=spec))

    def _truncate_for_prefill(self, request: Request, params: dict[str, Any]) -> None:
        backoff = self.prefill_backoff
        if (
            not backoff
            or params.get(kvp.PREFILL_TRUNCATED)
            or request.num_prompt_tokens <= backoff
            or request.prompt_token_ids is None
            or request.get_skip_reading_prefix_cache()
        ):
            return
        compat.truncate_prompt(request, backoff)  # a Request has no API to be shortened
        params[kvp.PREFILL_TRUNCATED] = True

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta, self._meta = self._meta, PDConnectorMetadata()
        return meta

    # -- consumer --------------------------------------------------------------------------

    def _lease(self, request: Request) -> KVParams | None:
        """The producer's lease this consumer request still has to pull or release, if any."""
        params = request.kv_transfer_params
        if not (self.is_consumer and kvp.wants_remote_prefill(params)) or params.get(kvp.PULL_PLANNED):
            return None
        try:
            return KVParams.from_dict(params)
        except ValueError:
            return None  # update_state_after_alloc says why, once

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        awaiting = self._awaiting.get(request.request_id)
        if awaiting is not None and not request.kv_transfer_params.get(kvp.PULL_PLANNED):
            # The whole prompt comes with the lease (the prefill computes exactly these tokens);
            # the first token it samples is appended before the request is computed.
            count = request.num_prompt_tokens - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        lease = self._lease(request)
        if lease is None:
            return 0, False
        count = min(lease.remote_num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        awaiting = self._awaiting.get(request.request_id)
        if awaiting is not None and not params.get(kvp.PULL_PLANNED):
            self._plan_awaited_pull(request, blocks, num_external_tokens, awaiting[1])
            return
        lease = self._lease(request)
        if lease is None:
            if self.is_consumer and kvp.wants_remote_prefill(params) and not params.get(kvp.PULL_PLANNED):
                try:
                    KVParams.from_dict(params)
                except ValueError as exc:
                    logger.warning("request %s: %s; computing its prompt locally", request.request_id, exc)
                params[kvp.PULL_PLANNED] = True
            return
        params[kvp.PULL_PLANNED] = True
        if num_external_tokens <= 0:
            # Everything was in the local prefix cache: P's blocks are not needed.
            self._meta.releases.append(ReleaseSpec(lease, "local prefix cache hit"))
            return
        block_ids, num_cached = compat.blocks_and_local_hit(blocks)
        total = cdiv(num_cached * self.block_size + num_external_tokens, self.block_size)
        local = block_ids[num_cached:total]
        remote = lease.remote_block_ids[num_cached:total]
        if len(local) != len(remote) or len(remote) != total - num_cached:
            logger.error(
                "request %s: cannot map %d producer blocks onto %d local blocks; "
                "the pull will fail and follow the load-failure policy",
                request.request_id,
                len(remote),
                len(local),
            )
        self._meta.pulls.append(PullSpec(request.request_id, lease, tuple(remote), tuple(local)))

    def _plan_awaited_pull(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int, spec: AwaitParams
    ) -> None:
        request.kv_transfer_params[kvp.PULL_PLANNED] = True
        if num_external_tokens <= 0:
            # vLLM declined the load (a request that skips the prefix cache): it will compute
            # the prompt itself, without the prefill's first token. The router sends none such.
            logger.error("request %s admitted ahead of its prefill computes its prompt itself", request.request_id)
            self._awaiting.pop(request.request_id, None)
            return
        block_ids, num_cached = compat.blocks_and_local_hit(blocks)
        num_tokens = num_cached * self.block_size + num_external_tokens
        total = cdiv(num_tokens, self.block_size)
        self._meta.pulls.append(
            PullSpec(
                request.request_id,
                None,
                (),
                tuple(block_ids[num_cached:total]),
                awaiting=spec,
                remote_offset=num_cached,
                num_tokens=num_tokens,
            )
        )

    def update_connector_output(self, output: Any) -> None:
        """The prefill's first token of requests admitted ahead of it: their last prompt token,
        before vLLM computes them (their load is reported in this output or a later one)."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        for request_id, token in getattr(meta, "first_tokens", {}).items():
            entry = self._awaiting.pop(request_id, None)
            if entry is not None:
                compat.extend_prompt(entry[0], token)

    # -- producer (and consumer cleanup) -----------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.is_consumer and kvp.wants_lease_await(params):
            entry = self._awaiting.pop(request.request_id, None)
            if entry is not None and not params.get(kvp.PULL_PLANNED):
                # Ended before its blocks were allocated (in decode's queue): its prefill may
                # still file a lease under its key; the worker releases it if it comes.
                self._meta.forsaken.append(PullSpec(request.request_id, None, (), (), awaiting=entry[1]))
            if params.get(kvp.PULL_PLANNED):
                # Every worker hears it ended: one still looking stops, one that gave up reports
                # its load now (vLLM frees the blocks once every rank has). Even after its first
                # token came: under tensor parallelism another rank may have found the lease
                # while this one gave up. A worker with a pull of its own ignores it.
                self._meta.abandoned.append(request.request_id)
        if self.is_consumer and kvp.wants_remote_prefill(params) and not params.get(kvp.PULL_PLANNED):
            # Dropped before its blocks were allocated (abort, rejection): free P's blocks now
            # instead of leaving them to the lease timeout.
            params[kvp.PULL_PLANNED] = True
            try:
                lease = KVParams.from_dict(params)
            except ValueError:
                return False, None
            self._meta.releases.append(ReleaseSpec(lease, f"request {request.status.name}"))
            return False, None
        if not (self.is_producer and kvp.wants_remote_decode(params)):
            return False, None
        if request.status == RequestStatus.FINISHED_STOPPED and params.get(kvp.STOP_ENDS):
            # The router answers it from the prefill's answer: nobody pulls. A decode request
            # sent ahead (decode_ahead) looks its key up: it learns at once that no lease comes.
            if key := kvp.lease_key(params):
                self._file(LeaseSpec(request.request_id, (), 0.0, key=key, first_token=first_token(request)))
            return False, None
        if (
            request.status
            not in (
                RequestStatus.FINISHED_LENGTH_CAPPED,
                RequestStatus.FINISHED_STOPPED,
            )
            or not block_ids
        ):
            return False, None
        if None in self.endpoints:
            logger.error("no KV endpoint known for engine %s; freeing blocks", self.engine_id)
            return False, None
        expiry = time.time() + self.settings.lease_seconds
        lease = KVParams(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_endpoints=tuple(str(e) for e in self.endpoints),
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=request.num_computed_tokens,
            remote_lease_expiry=expiry,
            remote_lease_seconds=self.settings.lease_seconds,
        ).signed(self._params_key)
        key = kvp.lease_key(params)
        handout = {}
        if key:
            handout = {"key": key, "params": json.dumps(lease.to_dict()), "first_token": first_token(request)}
        self._file(LeaseSpec(request.request_id, tuple(block_ids), expiry, **handout))
        return True, lease.to_dict()

    def _file(self, spec: LeaseSpec) -> None:
        if not colocated.file_lease(self.engine_id, spec):  # our worker half here: now, not next step
            self._meta.new_leases.append(spec)
