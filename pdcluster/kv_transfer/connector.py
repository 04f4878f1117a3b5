"""`PDConnector`: pdcluster's out-of-tree vLLM KV connector (KVConnectorBase_V1, vLLM 0.32).

Load it with:
    KVTransferConfig(kv_connector="PDConnector",
                     kv_connector_module_path="pdcluster.kv_transfer.connector",
                     kv_role="kv_producer" | "kv_consumer", engine_id=...,
                     kv_load_failure_policy="recompute" | "fail",
                     kv_connector_extra_config={...})   # see settings.py

This class is a thin facade: vLLM makes one instance per role, and every call is forwarded to
the scheduler half (scheduler.py, in the engine core) or the worker half (worker.py, in each
model-runner process). The handoff is a pull: P keeps the blocks of a finished prefill under a
lease, D pulls them and releases the lease.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from pdcluster.kv_transfer.metadata import PDConnectorMetadata
from pdcluster.kv_transfer.scheduler import ConnectorScheduler
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.stats import PDTransferStats
from pdcluster.kv_transfer.worker import ConnectorWorker
from pdcluster.vllm_plugin import request_amx_permission

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class PDConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        kv_config = vllm_config.kv_transfer_config
        assert kv_config is not None
        self.settings = KVTransferSettings.from_connector_config(kv_config.kv_connector_extra_config)
        self.engine_id = str(kv_config.engine_id)
        is_producer = bool(kv_config.is_kv_producer)
        is_consumer = bool(kv_config.is_kv_consumer)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(
                vllm_config,
                self.settings,
                self.engine_id,
                is_producer=is_producer,
                is_consumer=is_consumer,
            )
        else:
            # The model runs in this process: make sure the CPU attention kernel may use AMX
            # even when its first step is a decode on transferred KV (see vllm_plugin.py).
            request_amx_permission()
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            parallel = vllm_config.parallel_config
            self.connector_worker = ConnectorWorker(
                self.settings,
                self.engine_id,
                model=vllm_config.model_config.served_model_name,
                block_size=vllm_config.cache_config.block_size,
                num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else None,
                tp_size=parallel.tensor_parallel_size,
                tp_rank=get_tensor_model_parallel_rank(),
                is_producer=is_producer,
                is_consumer=is_consumer,
            )

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self.connector_worker is not None
        return self.connector_worker.handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.connector_worker is not None
        assert isinstance(connector_metadata, PDConnectorMetadata)
        self.connector_worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Pulls were submitted in bind_connector_metadata and run between steps.
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Pull model: nothing is pushed; blocks are read from the cache when D asks.
        return

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.after_forward()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        sending, recving, failed = self.connector_worker.get_finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.connector_worker is not None
        return self.connector_worker.worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PDTransferStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ==============================
    # Scheduler-side methods
    # ==============================

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_worker_endpoints(metadata)

    def on_new_request(self, request: Request) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)
