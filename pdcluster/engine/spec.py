"""EngineSpec: everything needed to start one vLLM engine in one role.

The controller derives one spec per replica from the cluster config; tests and `make run` build
them directly. `engine_kwargs()` maps a spec onto vLLM's `AsyncEngineArgs` (the KV connector,
speculative decoding and async scheduling included); `env()` gives the per-engine environment
(CPU thread binding, KV cache size) the engine process must start with.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pdcluster.errors import ConfigError

# How long a worker's step queue spins before it sleeps (vllm_plugin.py reads it in the engine's
# processes). Here, not there: importing the plugin imports torch, and the CLI imports this module.
WORKER_SPIN_ENV = "PDCLUSTER_WORKER_SPIN_MS"

Role = Literal["prefill", "decode", "aggregated"]
CONNECTOR_MODULE = "pdcluster.kv_transfer.connector"
CONNECTOR_CLASS = "PDConnector"


@dataclass
class EngineSpec:
    role: Role
    engine_id: str
    model: str
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    async_scheduling: bool | None = None
    # kv_connector_extra_config: KVTransferSettings.connector_config(); None for aggregated engines
    kv_extra: dict[str, Any] | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 0
    http_advertise_host: str | None = None  # set when http_host is a wildcard
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-1"
    cpu_bind_scope: str = "engine"  # replica: every thread of the engine's processes (cpu_bind.py)
    kv_cache_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    onednn_cache: int | None = None  # ONEDNN_PRIMITIVE_CACHE_CAPACITY (None: oneDNN's default)
    worker_spin_ms: float | None = None  # step-queue busy-wait (vllm_plugin; None: vLLM's 1 s)
    single_process: bool = True  # CPU: model in the engine-core process (engine/single_process.py)
    kv_events: bool = False  # publish KV cache events to the router (engine/kv_events.py)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.role == "aggregated":
            return None
        if self.kv_extra is None:
            raise ConfigError(f"engine {self.engine_id}: role {self.role} needs KV transfer settings")
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "engine_id": self.engine_id,
            # vLLM's own knob, from the one KV settings model (kv_transfer.failure_policy)
            "kv_load_failure_policy": self.kv_extra.get("failure_policy", "recompute"),
            "kv_connector_extra_config": self.kv_extra,
        }

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vllm.engine.arg_utils.AsyncEngineArgs."""
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        valid = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(self.engine_args) - valid)
        if unknown:
            raise ConfigError(
                f"engine_args: unknown vLLM engine arguments {unknown} "
                "(use AsyncEngineArgs field names, e.g. max_num_seqs)"
            )
        kwargs: dict[str, Any] = {
            "model": self.model,
            "served_model_name": [self.name],
            "dtype": self.dtype,
            **self.engine_args,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.speculative:
            kwargs["speculative_config"] = dict(self.speculative)
        if self.async_scheduling is not None:
            kwargs["async_scheduling"] = self.async_scheduling
        kv = self.kv_transfer_config()
        if kv is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
        return kwargs

    def env(self) -> dict[str, str]:
        from pdcluster.compat import ENGINE_MARKER_ENV

        env = dict(self.extra_env)
        # Marks the engine's processes (vLLM's engine core and workers inherit it) as pdcluster's:
        # our vLLM plugin applies its process-level fixes only where it is set (vllm_plugin.py).
        env[ENGINE_MARKER_ENV] = "1"
        if self.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        if self.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.onednn_cache is not None:
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(self.onednn_cache)
        if self.worker_spin_ms is not None:
            env[WORKER_SPIN_ENV] = f"{self.worker_spin_ms:g}"
        return env

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**json.loads(text))
