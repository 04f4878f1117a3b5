"""What the controller starts for a replica: the Ray actor class of its role and the EngineSpec
of its engine, mapped from the cluster config (the one place that mapping lives), and the model's
generation defaults the router counts as a request's own."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pdcluster.config import ClusterConfig, RoleName
from pdcluster.engine.spec import EngineSpec

logger = logging.getLogger(__name__)


def worker_class(role: RoleName):
    """The Ray actor class hosting a replica of `role`."""
    if role == "prefill":
        from pdcluster.prefill_worker import PrefillWorker

        return PrefillWorker
    if role == "decode":
        from pdcluster.decode_worker import DecodeWorker

        return DecodeWorker
    from pdcluster.engine.actor import EngineActor

    return EngineActor


def engine_spec(config: ClusterConfig, role: RoleName, index: int, replica_id: str) -> EngineSpec:
    """The EngineSpec of replica `index` of `role` (the one mapping from config to engines).

    The KV secret is not part of it: the actor receives it separately and writes it to a private
    file on its own node (EngineActor), so specs can be logged and shown.
    """
    section = config.role(role)
    kv = config.kv_transfer
    # The engine actor adds the node-local secret file (and the address peers dial).
    kv_extra = kv.connector_config() if role != "aggregated" else None
    async_sched = section.async_scheduling
    if async_sched is None and role == "decode":
        async_sched = True
    engine_args = dict(section.engine_args)
    if config.model.tokenizer:
        engine_args["tokenizer"] = config.model.tokenizer
    return EngineSpec(
        role=role,
        engine_id=f"{config.name}-{replica_id}",
        model=config.model.path,
        served_model_name=config.model.served_name,
        dtype=config.model.dtype,
        max_model_len=config.model.max_model_len,
        engine_args=engine_args,
        speculative=config.speculative.vllm_config() if config.speculative else None,
        async_scheduling=async_sched,
        kv_extra=kv_extra,
        http_host=kv.bind_host,
        cpu_threads_bind=section.bind_for(index),
        cpu_bind_scope=section.cpu_bind_scope,
        kv_cache_gib=section.kv_cache_gib,
        onednn_cache=section.onednn_cache,
        worker_spin_ms=section.worker_spin_ms,
        single_process=section.single_process,
        kv_events=config.router.policy == "cache_aware",
    )


def generation_defaults(model_path: str) -> dict[str, Any]:
    """The request defaults of the model's generation_config.json (vLLM applies them to every
    engine's requests), when the model is a directory this node can read; else none."""
    from pdcluster.orchestrator.router.continuation import request_defaults

    path = Path(model_path) / "generation_config.json"
    try:
        return request_defaults(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s (%s): the router decides without the model's defaults", path, exc)
        return {}
