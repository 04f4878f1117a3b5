"""Scheduler half of the connector (runs in the engine core, beside vLLM's scheduler).

Producer (prefill engine), per request with `do_remote_decode`:
  on_new_request      trims MTP's prefill backoff off the prompt (the consumer recomputes it)
  request_finished    keeps the blocks (returns True), announces a lease to the worker, and returns
                      the params a consumer needs: engine id, endpoints, block ids, token count,
                      lease expiry
Consumer (decode engine), per request with `do_remote_prefill`:
  get_num_new_matched_tokens   the prefilled tokens, loadable asynchronously
  update_state_after_alloc     plans the pull: producer blocks -> the freshly allocated blocks
  request_finished             a request dropped before its pull still releases P's lease
`build_connector_meta` hands the step's leases, pulls and releases to the worker half.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pdcluster.kv_transfer import metadata as md
from pdcluster.kv_transfer.metadata import (
    LeaseSpec,
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PullSpec,
    ReleaseSpec,
    RemotePrefill,
)
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION
from pdcluster.kv_transfer.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ConnectorScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: ConnectorSettings,
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
        self.server_info: PDHandshakeMetadata | None = None  # rank 0's offers, node, device
        self._meta = PDConnectorMetadata()
        # consumer: request id -> tokens its local prefix cache already holds (asked, not yet
        # allocated); vLLM updates request.num_computed_tokens only after the allocation
        self._local_hits: dict[str, int] = {}

    # -- startup ---------------------------------------------------------------------------

    def set_worker_endpoints(self, metadata: dict[int, Any]) -> None:
        for tp_rank, meta in metadata.items():
            if isinstance(meta, PDHandshakeMetadata) and 0 <= tp_rank < self.tp_size:
                self.endpoints[tp_rank] = meta.endpoint
                if tp_rank == 0:
                    self.server_info = meta
        if self.is_producer:
            logger.info("KV endpoints of engine %s: %s", self.engine_id, self.endpoints)

    # -- both roles ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self.is_producer and params and params.get(md.DO_REMOTE_DECODE):
            self._truncate_for_prefill(request, params)

    def _truncate_for_prefill(self, request: Request, params: dict[str, Any]) -> None:
        backoff = self.prefill_backoff
        if (
            not backoff
            or params.get(md._P_TRUNCATED)
            or request.num_prompt_tokens <= backoff
            or request.prompt_token_ids is None
            or request.get_skip_reading_prefix_cache()
        ):
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params[md._P_TRUNCATED] = True

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta, self._meta = self._meta, PDConnectorMetadata()
        return meta

    # -- consumer --------------------------------------------------------------------------

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get(md.DO_REMOTE_PREFILL)):
            return None
        if params.get(md._PULL_PLANNED):
            return None
        try:
            return RemotePrefill.from_params(params)
        except ValueError as exc:
            logger.warning("request %s: %s; computing its prompt locally", request.request_id, exc)
            params[md._PULL_PLANNED] = True
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        remote = self._remote_prefill(request)
        if remote is None:
            return 0, False
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        remote = self._remote_prefill(request)
        if remote is None:
            return
        request.kv_transfer_params[md._PULL_PLANNED] = True
        local_hit = self._local_hits.pop(request.request_id, 0)  # block-aligned (vLLM asks so)
        if num_external_tokens <= 0:
            # Everything was in the local prefix cache: P's blocks are not needed.
            self._meta.releases.append(ReleaseSpec(remote, "local prefix cache hit"))
            return
        num_cached = local_hit // self.block_size
        total = cdiv(local_hit + num_external_tokens, self.block_size)
        # The request's blocks in token order: its local prefix-cache hits, then the new ones
        # (one KV cache group: unpacking raises on more, as get_unhashed_block_ids asserted).
        (group,) = blocks.get_block_ids()
        local = group[num_cached:total]
        remote_ids = remote.block_ids[num_cached:total]
        if len(local) != len(remote_ids) or len(remote_ids) != total - num_cached:
            logger.error(
                "request %s: cannot map %d producer blocks onto %d local blocks; "
                "the pull will fail and follow the load-failure policy",
                request.request_id, len(remote_ids), len(local),
            )
        self._meta.pulls.append(
            PullSpec(request.request_id, remote, tuple(remote_ids), tuple(local))
        )

    # -- producer (and consumer cleanup) -----------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._local_hits.pop(request.request_id, None)
        if not params:
            return False, None
        if self.is_consumer and params.get(md.DO_REMOTE_PREFILL) and not params.get(
            md._PULL_PLANNED
        ):
            # Dropped before its blocks were allocated (abort, rejection): free P's blocks now
            # instead of leaving them to the lease timeout.
            params[md._PULL_PLANNED] = True
            try:
                remote = RemotePrefill.from_params(params)
            except ValueError:
                return False, None
            self._meta.releases.append(ReleaseSpec(remote, f"request {request.status.name}"))
            return False, None
        if not (self.is_producer and params.get(md.DO_REMOTE_DECODE)):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not block_ids:
            return False, None
        if None in self.endpoints:
            logger.error("no KV endpoint known for engine %s; freeing blocks", self.engine_id)
            return False, None
        expiry = time.time() + self.settings.lease_s
        self._meta.new_leases.append(LeaseSpec(request.request_id, tuple(block_ids), expiry))
        first_host, _, first_port = str(self.endpoints[0]).rpartition(":")
        return True, {
            md.DO_REMOTE_PREFILL: True,
            md.DO_REMOTE_DECODE: False,
            md.REMOTE_ENGINE_ID: self.engine_id,
            md.REMOTE_REQUEST_ID: request.request_id,
            md.REMOTE_HOST: first_host,
            md.REMOTE_PORT: int(first_port),
            md.REMOTE_ENDPOINTS: list(self.endpoints),
            md.REMOTE_BLOCK_IDS: list(block_ids),
            md.REMOTE_NUM_TOKENS: request.num_computed_tokens,
            md.REMOTE_LEASE_EXPIRY: expiry,
            md.TRANSPORT: self.settings.transport,
            md.KV_BACKENDS: list(self.server_info.offers) if self.server_info else [],
            md.KV_NODE: self.server_info.node_id if self.server_info else "",
            md.KV_DEVICE: self.server_info.device_kind if self.server_info else "",
            md.PROTOCOL: PROTOCOL_VERSION,
            "tp_size": self.tp_size,
        }
