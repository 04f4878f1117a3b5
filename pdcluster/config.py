"""The cluster YAML: one pydantic schema, the single source of truth for every component.

`validate_config(data)` validates a parsed YAML (config_files.load_config reads a file); errors
name the YAML path of the offending key (`roles.decode.replicas: must be ≥ 0`). Cross-field rules
enforce the P/D invariants: both roles serve the same model with the same tokenizer,
KV-compatible engine settings (block size, KV cache dtype), and one speculative config. Each
replica's EngineSpec is derived from it in one place (orchestrator/engines.py), so the
controller, tests and benchmarks build engines the same way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from pdcluster.errors import ConfigError, format_errors
from pdcluster.kv_transfer.settings import KVTransferSettings

RoleName = Literal["prefill", "decode", "aggregated"]

# Engine arguments the cluster owns: set once at the top level, never per role.
RESERVED_ENGINE_ARGS = {
    "model": "model.path",
    "tokenizer": "model.tokenizer",
    "served_model_name": "model.name",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "kv_transfer_config": "kv_transfer",
    "speculative_config": "speculative",
    "async_scheduling": "roles.<role>.async_scheduling",
}
# Engine arguments that would make one replica several engines: a replica is one engine, with
# its cores, KV endpoint and stats (vLLM's data-parallel ranks would share them all).
ONE_ENGINE_ARGS = {"data_parallel_size": "roles.<role>.replicas", "data_parallel_size_local": "roles.<role>.replicas"}
# Engine arguments that must agree between prefill and decode for the KV handoff to work.
KV_COMPATIBLE_ENGINE_ARGS = ("block_size", "kv_cache_dtype", "tensor_parallel_size")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelSection(_Model):
    path: str = Field(description="Model directory (or hub id where a hub is reachable).")
    name: str | None = Field(None, description="Served model name; default: the path's basename.")
    tokenizer: str | None = Field(None, description="Tokenizer path; default: the model path.")
    dtype: str = Field("auto", description="Weights/activation dtype: vLLM's `dtype`, or `native` (engine/dtype.py).")
    max_model_len: int | None = Field(None, ge=16, description="Context length (prompt + output).")

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).name


class Resources(_Model):
    cpus: float = Field(0, ge=0, description="Ray CPUs reserved per replica actor.")
    gpus: float = Field(0, ge=0, description="NVIDIA GPUs per replica (Ray `num_gpus`).")
    npus: float = Field(0, ge=0, description="Ascend NPUs per replica (Ray resource `NPU`).")


# Ray's label syntax: a name of ≤ 63 letters, digits, '-', '_', '.'; keys may carry a 'prefix/'.
_LABEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([A-Za-z0-9.-]{{1,253}}/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}$")


class Placement(_Model):
    """Which Ray nodes may host something: all `labels` on the node, and `resources` free there."""

    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels the node must carry, every one with exactly this value "
        "(`ray start --labels pool=decode,zone=a`).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each replica reserves on its node "
        "(`ray start --resources '{\"decode_slots\": 2}'`).",
    )

    @field_validator("labels", mode="before")
    @classmethod
    def _label_numbers(cls, value: Any) -> Any:
        """A YAML number as a label value (`zone: 1`) is the label's text, as Ray's own labels are."""
        if isinstance(value, dict):
            return {k: str(v) if type(v) is int else v for k, v in value.items()}
        return value

    @field_validator("labels")
    @classmethod
    def _label_format(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"'{key}' is not a Ray label key (letters, digits, - _ . ; an optional 'prefix/')")
            if not _LABEL_VALUE.match(label):
                raise ValueError(f"'{key}: {label}' is not a Ray label value (letters, digits, - _ .; ≤ 63)")
        return value

    @field_validator("resources")
    @classmethod
    def _resource_amounts(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if amount <= 0 or name in ("CPU", "GPU", "NPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"'{name}: {amount}': custom resources only, each > 0 (CPUs, GPUs and NPUs go under resources)"
                )
        return value


class RoleSection(_Model):
    replicas: int = Field(1, ge=0, le=64, description="Number of engines in this role.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments (AsyncEngineArgs field names), e.g. max_num_seqs.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-replica resources.")
    placement: Placement = Field(
        default_factory=Placement, description="On a Ray cluster of several nodes: which nodes may host this role."
    )
    cpu_bind: list[str] = Field(
        default_factory=list,
        description="CPU only: cores each replica's engine threads bind to "
        "(VLLM_CPU_OMP_THREADS_BIND), one entry per replica, cycled; e.g. ['0', '1'] or ['0-3'].",
    )
    cpu_bind_scope: Literal["engine", "replica"] = Field(
        "engine",
        description="CPU, with cpu_bind: what runs on a replica's cores. engine: the threads that "
        "run its forwards. replica: every thread of every process of the replica (its actor: "
        "vLLM's front end and HTTP app; its engine core and workers), so its work outside the "
        "forwards (e.g. a decode request admitted ahead of its prefill) cannot take another "
        "role's core, and shares the replica's own instead. The router stays unbound.",
    )
    kv_cache_gib: int | None = Field(
        None, ge=1, description="CPU only: KV cache size per engine, whole GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    onednn_cache: int = Field(
        128,
        ge=0,
        description="CPU only: oneDNN primitive cache entries per engine process "
        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY). oneDNN keeps a compiled kernel per GEMM shape and a "
        "prefill engine meets a new shape with every batch token count: with oneDNN's default "
        "of 1024 entries its RSS keeps growing long after start.",
    )
    worker_spin_ms: float | None = Field(
        5.0,
        ge=0,
        description="Engines with a worker process (see single_process): how long the "
        "workers busy-wait for their next step before sleeping "
        "(vLLM: 1 s after every step, so a prefill engine fed every few hundred ms spins a core "
        "the router and the other engine need). With it set, engine cores wait for their "
        "workers' results without spinning. null keeps vLLM's 1 s everywhere.",
    )
    single_process: bool = Field(
        True,
        description="CPU only: run the model in the engine-core process, bound to this role's "
        "cpu_bind cores, instead of the separate worker process vLLM's CPU platform always "
        "starts (needs cpu_bind and one worker per engine; otherwise the engine keeps its worker "
        "process and `status` says why). No step then crosses a process.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="vLLM async scheduling. Default: on for decode, engine default elsewhere. "
        "Platforms that cannot run it (vLLM's CPU platform) turn it off; `status` shows why.",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in RESERVED_ENGINE_ARGS:
                raise ValueError(
                    f"'{key}' is set once for the cluster, under {RESERVED_ENGINE_ARGS[key]} "
                    "(prefill and decode must agree on it)"
                )
            if key in ONE_ENGINE_ARGS and value[key] not in (None, 1):
                raise ValueError(
                    f"'{key}: {value[key]}' would make each replica {value[key]} engines sharing its cores and "
                    f"KV endpoint: scale with {ONE_ENGINE_ARGS[key]} instead (one engine per replica)"
                )
        return value

    @field_validator("cpu_bind", mode="before")
    @classmethod
    def _cpu_bind_format(cls, value: Any) -> Any:
        """Each entry a core list like 0, '0-3' or '0,2' (a YAML number is one core)."""
        if not isinstance(value, list):
            return value  # the field's own type error
        for entry in value:
            if type(entry) is int and entry >= 0:
                continue
            ranges = [part.strip().split("-") for part in str(entry).split(",")]
            if not all(1 <= len(r) <= 2 and all(n.isdigit() for n in r) and int(r[0]) <= int(r[-1]) for r in ranges):
                raise ValueError(f"'{entry}' is not a core list like '0', '0-3' or '0,2' (ranges low-high)")
        return [str(v) for v in value]

    @model_validator(mode="after")
    def _scope_has_cores(self) -> RoleSection:
        if self.cpu_bind_scope == "replica" and not self.cpu_bind:
            raise ValueError("cpu_bind_scope: 'replica' needs cpu_bind (the cores each replica is bound to)")
        return self

    def bind_for(self, index: int) -> str | None:
        return self.cpu_bind[index % len(self.cpu_bind)] if self.cpu_bind else None


class Roles(_Model):
    prefill: RoleSection = Field(default_factory=RoleSection, description="Prefill engines (KV producers).")
    decode: RoleSection = Field(default_factory=RoleSection, description="Decode engines (KV consumers).")
    aggregated: RoleSection = Field(
        default_factory=lambda: RoleSection(replicas=0),
        description="Engines doing both phases (mode: aggregated).",
    )


class RouterFaultInjection(_Model):
    abandon_after_prefill_rate: float = Field(
        0.0, ge=0, le=1, description="Drop this share of requests between prefill and decode (a client gone)."
    )


class SpeculativeSection(_Model):
    method: Literal["mtp"] = Field("mtp", description="Speculative method (MTP heads of the model).")
    num_speculative_tokens: int = Field(1, ge=1, le=8, description="Draft tokens per step (k).")

    def vllm_config(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}


class RouterSection(_Model):
    host: str = Field("127.0.0.1", description="Address the OpenAI-compatible endpoint binds.")
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the endpoint; 0 takes any free port when the router binds (`up` prints the endpoint, "
        "`status` shows it).",
    )
    policy: Literal["least_loaded", "round_robin", "cache_aware"] = Field(
        "cache_aware",
        description="Replica choice: least outstanding work, round robin, or cache_aware (least work counting "
        "what each replica's KV cache already holds of the prompt, from the engines' KV cache events).",
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="Conditional disaggregation: a request whose decode replica would compute at most this many "
        "prompt tokens (its cache holds the rest, or the prompt is that short) skips the prefill hop and the KV "
        "transfer (0: never).",
    )
    local_prefill_queue_tokens: int = Field(
        0,
        ge=0,
        le=1 << 24,
        description="Conditional disaggregation by load: a request with at most this many prompt tokens to compute, "
        "whose prompt would queue behind at least this many on every ready prefill replica, is prefilled by its "
        "decode replica; longer prompts always take the prefill (0: never).",
    )
    api_keys: list[str] = Field(default_factory=list, description="Accepted Bearer keys (empty: open).")
    api_keys_file: str | None = Field(None, description="File with one API key per line.")
    request_timeout_seconds: float = Field(
        600, gt=0, le=86400, description="Upper bound on one whole request (and on each read from a replica)."
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Larger request bodies get 413.")
    first_token_from_prefill: bool = Field(
        True,
        description="Stream the prefill's first token at once; decode continues after it "
        "(streaming requests whose fields allow it; see README).",
    )
    decode_ahead: bool = Field(
        True,
        description="With first_token_from_prefill: send the decode request together with the prefill "
        "request; decode waits for the lease and the prefill's first token, found by a key the "
        "router gives both (no second hop through the router; see README).",
    )
    migration_limit: int = Field(
        2,
        ge=0,
        le=16,
        description="A stream whose decode replica fails mid-stream continues on another one, at most "
        "this many times (0: it ends with an error event).",
    )
    placement: Placement | None = Field(
        None,
        description="Where the router and the controller run (their node's address is the endpoint); "
        "default: the Ray head node.",
    )
    fault_injection: RouterFaultInjection = Field(default_factory=RouterFaultInjection, description="Tests/drills.")

    def read_api_keys(self) -> list[str]:
        """`api_keys` plus those of `api_keys_file` (one per line, `#` starts a comment line). A
        file that holds no key is refused, as an empty secret_file is: it would leave the router
        open while the operator meant to close it."""
        keys = list(self.api_keys)
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"router.api_keys_file: {exc.strerror or exc} ({self.api_keys_file})") from None
            found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not found:
                raise ConfigError(f"router.api_keys_file: {self.api_keys_file} holds no key")
            keys += found
        return keys


class AutoscaleRole(_Model):
    min: int = Field(1, ge=0, le=64, description="Fewest replicas the planner keeps.")
    max: int = Field(2, ge=0, le=64, description="Most replicas the planner starts.")

    @model_validator(mode="after")
    def _ordered(self) -> AutoscaleRole:
        if self.min > self.max:
            raise ValueError(f"min: must be ≤ max ({self.min} > {self.max})")
        return self


class AutoscaleSection(_Model):
    """The SLO planner (orchestrator/planner.py): sizes prefill and decode to meet TTFT and ITL."""

    enabled: bool = Field(False, description="Run the planner (disaggregated mode).")
    mode: Literal["act", "advise"] = Field(
        "act", description="act: scale through the scale-and-drain path; advise: only log and expose the decisions."
    )
    ttft_p90_ms: float = Field(1000, gt=0, le=3_600_000, description="Target: p90 time to first token (router view).")
    itl_p90_ms: float = Field(100, gt=0, le=3_600_000, description="Target: p90 inter-token latency (router view).")
    prefill: AutoscaleRole = Field(default_factory=AutoscaleRole, description="Prefill replicas' bounds.")
    decode: AutoscaleRole = Field(default_factory=AutoscaleRole, description="Decode replicas' bounds.")
    budget: int | None = Field(
        None, ge=1, le=128, description="Most replicas of both roles together (default: the two maxima's sum)."
    )
    interval_seconds: float = Field(10, gt=0, le=3600, description="How often the planner decides.")
    window_seconds: float = Field(
        30, gt=0, le=3600, description="The latencies it reads: the router's p90 over this many seconds."
    )
    cooldown_seconds: float = Field(60, ge=0, le=86400, description="No action within this long of the last one.")
    hysteresis: int = Field(3, ge=1, le=100, description="Intervals in a row a rule must hold before it acts.")
    margin: float = Field(0.3, gt=0, lt=1, description="Targets met with margin: p90 ≤ (1 - margin) x target.")
    kv_high: float = Field(0.9, gt=0, le=1, description="Decode KV cache usage that adds a decode replica.")
    start_timeout_seconds: float = Field(
        600,
        gt=0,
        le=86400,
        description="A replica the planner added that is not ready this long after is scaled away again, and its"
        " role reported unplaceable for a cooldown (Ray holds an actor whose resources are taken for as long as they are).",
    )

    @model_validator(mode="after")
    def _budget_fits(self) -> AutoscaleSection:
        if self.budget is not None and self.budget < self.prefill.min + self.decode.min:
            raise ValueError(f"budget: must be ≥ prefill.min + decode.min ({self.prefill.min + self.decode.min})")
        return self

    def total_budget(self) -> int:
        return self.budget if self.budget is not None else self.prefill.max + self.decode.max


class RaySection(_Model):
    address: str | None = Field(None, description="Existing cluster (e.g. 127.0.0.1:6379); empty: start a local head.")
    namespace: str = Field("pdcluster", description="Ray namespace of the controller and actors.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local head (default: all).")


class ClusterConfig(_Model):
    """A pdcluster deployment: one model, prefill and decode pools, the KV handoff, the router."""

    name: str = Field("pdcluster", pattern=r"^[a-zA-Z0-9_-]+$", description="Cluster name (actor names).")
    model: ModelSection = Field(description="The one model both roles serve.")
    mode: Literal["disaggregated", "aggregated"] = Field(
        "disaggregated", description="disaggregated: prefill -> decode; aggregated: each replica does both."
    )
    roles: Roles = Field(default_factory=Roles, description="Replica pools.")
    kv_transfer: KVTransferSettings = Field(default_factory=KVTransferSettings, description="KV handoff.")
    speculative: SpeculativeSection | None = Field(None, description="MTP speculative decoding (both roles).")
    router: RouterSection = Field(default_factory=RouterSection, description="HTTP endpoint.")
    autoscale: AutoscaleSection = Field(default_factory=AutoscaleSection, description="SLO planner (off by default).")
    ray: RaySection = Field(default_factory=RaySection, description="Where the actors run.")
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @property
    def base_dir(self) -> Path:
        """Directory relative paths in the file (secret_file, api_keys_file) resolve against."""
        return self._base_dir

    @model_validator(mode="after")
    def _pd_invariants(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            p, d = self.roles.prefill.engine_args, self.roles.decode.engine_args
            for key in KV_COMPATIBLE_ENGINE_ARGS:
                if p.get(key) != d.get(key):
                    raise ValueError(
                        f"roles.decode.engine_args.{key}: must equal roles.prefill.engine_args.{key} "
                        f"for the KV handoff (prefill {p.get(key)!r}, decode {d.get(key)!r})"
                    )
            if self.roles.decode.replicas == 0:
                raise ValueError(
                    "roles.decode.replicas: disaggregated mode needs ≥ 1 decode replica "
                    "(prefill may be 0: decode then computes every prompt)"
                )
        elif self.roles.aggregated.replicas == 0:
            raise ValueError("roles.aggregated.replicas: aggregated mode needs ≥ 1 replica")
        if self.autoscale.enabled:
            if self.mode != "disaggregated":
                raise ValueError("autoscale.enabled: the planner sizes prefill and decode (disaggregated mode)")
            if self.autoscale.decode.min < 1:
                raise ValueError(
                    "autoscale.decode.min: must be ≥ 1 (with no decode replica no request is served, "
                    "so none would show the planner the need for one)"
                )
            for role in ("prefill", "decode"):
                bounds, replicas = getattr(self.autoscale, role), self.role(role).replicas
                if not bounds.min <= replicas <= bounds.max:
                    raise ValueError(
                        f"roles.{role}.replicas: must be within autoscale.{role} min..max "
                        f"({bounds.min}..{bounds.max}), got {replicas}"
                    )
            if self.roles.prefill.replicas + self.roles.decode.replicas > self.autoscale.total_budget():
                raise ValueError("autoscale.budget: the configured replicas already exceed it")
        return self

    def serving_roles(self) -> tuple[RoleName, ...]:
        return ("prefill", "decode") if self.mode == "disaggregated" else ("aggregated",)

    def role(self, name: RoleName) -> RoleSection:
        return getattr(self.roles, name)


def validate_config(data: Any, source: str = "config") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(format_errors(exc))) from None


def json_schema() -> dict[str, Any]:
    return ClusterConfig.model_json_schema()
