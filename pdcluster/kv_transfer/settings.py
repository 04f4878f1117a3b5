"""The KV handoff's settings: one pydantic model, declared once, used everywhere.

`KVTransferSettings` is the cluster YAML's `kv_transfer` section (config.py embeds it), what the
controller hands each engine as vLLM's `kv_connector_extra_config` (`connector_config`), what the
connector reads back there (`from_connector_config`), and what transports run with. Free of vLLM
imports, so the CLI and the router can load it.

The secret never travels inline to an engine: the engine actor writes it to a private file on its
node and the connector config names that file (vLLM logs its engine config). In memory it is a
`SecretStr`, so a repr or a log line of the settings shows `**********`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from pdcluster.errors import ConfigError, format_errors

Backend = Literal["auto", "grpc", "shm", "collective", "mooncake"]
EPHEMERAL_PORTS = (0, 0)
MAX_CHUNK_LIMIT = 256 << 20  # gRPC messages carry a chunk; grpcio refuses sizes near 2 GiB
MIN_LEASE_S = 1.0  # shortest lease: a consumer renews every sixth of one (params.KVParams too)
DAY = 86400.0  # bound of every duration: timedelta and gRPC deadlines overflow far beyond it


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultInjection(_Section):
    """Faults for tests and drills; every rate defaults to 0 (1.0: the fault is certain)."""

    pull_failure_rate: float = Field(
        0.0, ge=0, le=1, description="Fail this share of KV pulls (after their first chunk)."
    )
    drop_release_rate: float = Field(0.0, ge=0, le=1, description="Never release this share of leases.")
    pull_delay_s: float = Field(0.0, ge=0, le=3600, description="Decode: stall each pull this long.")
    serve_delay_s: float = Field(
        0.0, ge=0, le=3600, description="Prefill: stall before serving a pull (pull timeouts) ..."
    )
    serve_delay_rate: float = Field(1.0, ge=0, le=1, description="... for this share of pulls.")
    push_delay_s: float = Field(
        0.0, ge=0, le=3600, description="Prefill: stall each direct shm push this long, mid-pull (fences)."
    )
    unreachable_rate: float = Field(0.0, ge=0, le=1, description="Decode: dial a closed port instead of the prefill.")
    seed: int = Field(0, description="Seed of the fault dice.")


class TLSSettings(_Section):
    """Mutual TLS on every KV control channel (for networks you do not trust). The files must
    exist at these paths on every node; relative paths resolve against the cluster YAML."""

    cert_file: str = Field(description="PEM certificate this engine presents (server and client).")
    key_file: str = Field(description="PEM private key of cert_file.")
    ca_file: str = Field(description="PEM CA bundle that signed every engine's certificate.")
    server_name: str | None = Field(
        None, description="Name to verify in producers' certificates (default: the address dialed)."
    )

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA bundle), or a ConfigError naming the field."""
        out = []
        for name in ("cert_file", "key_file", "ca_file"):
            path = Path(getattr(self, name))
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"kv_transfer.tls.{name}: {exc}") from None
            if not data.strip():
                raise ConfigError(f"kv_transfer.tls.{name}: {path} is empty")
            out.append(data)
        return out[0], out[1], out[2]

    def resolved(self, base_dir: Path) -> TLSSettings:
        def absolute(value: str) -> str:
            return value if Path(value).is_absolute() else str(base_dir / value)

        return self.model_copy(
            update={name: absolute(getattr(self, name)) for name in ("cert_file", "key_file", "ca_file")}
        )


class MooncakeSettings(_Section):
    """Mooncake's transfer engine (the `mooncake` backend; kv_transfer/transports/mooncake.py)."""

    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="tcp (any network; tested here) or rdma (IB/RoCE NICs; untested here)."
    )
    device_name: str = Field(
        "", description="rdma: the NIC(s) to use, e.g. 'mlx5_0' (empty: Mooncake picks by topology)."
    )
    device_memory: Literal["auto", "register", "stage"] = Field(
        "auto",
        description="Device caches (CUDA, NPU): register: Mooncake reads and writes them in place "
        "where its build can (its CUDA and NPU wheels; else staged); stage: through registered "
        "host slots; auto: register with rdma (GPUDirect), stage with tcp (Mooncake's TCP "
        "transport copies device memory through the host itself, and the event-synced staging "
        "was faster: bench/results/2026-12-04-device-checks.md).",
    )
    staging_chunk_bytes: int = Field(
        32 << 20,
        ge=4096,
        le=MAX_CHUNK_LIMIT,
        description="Staged reads (a device cache, or layers that are not contiguous rows): the "
        "largest chunk gathered into one registered host slot, read with one descriptor (the "
        "producer keeps two slots per concurrent pull, the consumer one landing buffer).",
    )
    in_place_min_run_bytes: int | None = Field(
        None,
        ge=0,
        description="Host caches: read a pull in place only where its runs of blocks consecutive on "
        "both sides average at least this many bytes per layer; shorter runs (a fragmented "
        "cache: one descriptor per block and layer) are read staged, gathered into chunks of one "
        "descriptor each, and scattered on arrival. Default: 1 MiB with tcp (Mooncake's TCP "
        "transport pays per descriptor), 0 with rdma (NICs take small descriptors at line rate).",
    )

    def run_floor(self) -> int:
        """`in_place_min_run_bytes` in effect for this protocol."""
        if self.in_place_min_run_bytes is not None:
            return self.in_place_min_run_bytes
        return 1 << 20 if self.protocol == "tcp" else 0


class KVTransferSettings(_Section):
    backend: Backend = Field(
        "auto",
        description="KV transport: auto (shm on one node; between nodes mooncake where both "
        "engines have it, else collective between same-kind accelerators, else grpc), or force "
        "grpc, shm (same node), collective (torch.distributed: gloo on CPU, NCCL on CUDA, HCCL "
        "on Ascend) or mooncake (Mooncake's transfer engine).",
    )
    mooncake: MooncakeSettings = Field(default_factory=MooncakeSettings, description="The mooncake backend.")
    bind_host: str = Field("127.0.0.1", description="Address KV servers bind to.")
    advertise_host: str | None = Field(
        None, description="Address decode engines dial; default: bind_host (or the node IP for 0.0.0.0)."
    )
    port_range: tuple[int, int] = Field(
        (47000, 47999), description="Ports KV servers may bind ([0, 0]: any free port)."
    )
    secret: SecretStr | None = Field(None, description="Shared secret; prefer secret_file.")
    secret_file: str | None = Field(None, description="File holding the shared secret.")
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="What decode does when a pull fails: recompute, or fail the request."
    )
    lease_seconds: float = Field(
        30, ge=MIN_LEASE_S, le=DAY, description="Prefill frees unclaimed KV after this long (at least 1 s)."
    )
    pull_timeout_seconds: float = Field(30, gt=0, le=DAY, description="Deadline of one KV pull.")
    release_timeout_seconds: float = Field(5, gt=0, le=DAY, description="Deadline of one lease release message.")
    lease_wait_seconds: float = Field(
        10, ge=0, le=DAY, description="Prefill: how long a pull may wait for its lease to be registered."
    )
    connect_timeout_seconds: float = Field(5, gt=0, le=DAY, description="Deadline of connecting to a KV server.")
    max_chunk_bytes: int = Field(4 << 20, ge=4096, le=MAX_CHUNK_LIMIT, description="Largest KV message.")
    pull_threads: int = Field(4, ge=1, le=64, description="Concurrent pulls per decode worker.")
    one_sided_reads: bool = Field(
        True,
        description="shm between host caches: once a producer's addresses are known, decode reads a "
        "live lease's blocks itself, without a call to the producer (its lease expiry bounds the "
        "read). Off: every pull asks the producer first.",
    )
    server_threads: int = Field(8, ge=1, le=256, description="Threads of each prefill's KV server.")
    tls: TLSSettings | None = Field(None, description="Mutual TLS on the KV channels (off: plaintext).")
    fault_injection: FaultInjection = Field(default_factory=FaultInjection, description="Tests/drills.")

    @model_validator(mode="after")
    def _ports_and_secret(self) -> KVTransferSettings:
        lo, hi = self.port_range
        if (lo, hi) != EPHEMERAL_PORTS and not (1024 <= lo <= hi <= 65535):
            raise ValueError(f"port_range: need 1024 ≤ low ≤ high ≤ 65535 (or [0, 0]), got [{lo}, {hi}]")
        if self.secret and self.secret_file:
            raise ValueError("set either secret or secret_file, not both")
        return self

    @property
    def host_for_peers(self) -> str:
        return self.advertise_host or self.bind_host

    def resolve_secret(self, base_dir: Path) -> str | None:
        """The secret value (inline, or read from secret_file relative to base_dir); None: unset."""
        if self.secret:
            return self.secret.get_secret_value()
        if self.secret_file:
            path = Path(self.secret_file)
            path = path if path.is_absolute() else base_dir / path
            try:
                value = path.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"kv_transfer.secret_file: {exc}") from exc
            if not value:
                raise ConfigError(f"kv_transfer.secret_file: {path} is empty")
            return value
        return None

    def secret_value(self) -> str:
        """The secret a running transport derives its keys from (set by from_connector_config)."""
        if self.secret is None:
            raise ConfigError("kv_transfer: no secret resolved for this KV endpoint")
        return self.secret.get_secret_value()

    def connector_config(self, secret_file: str | None = None) -> dict[str, Any]:
        """vLLM's `kv_connector_extra_config` for an engine: these settings without the secret
        itself (`secret_file` names the node-local file that holds it)."""
        out = self.model_dump(mode="json", exclude={"secret", "secret_file"})
        if secret_file is not None:
            out["secret_file"] = secret_file
        return out

    @classmethod
    def from_connector_config(cls, extra: dict[str, Any]) -> KVTransferSettings:
        """The connector's view: validated, with the secret read from `secret_file`."""
        if not extra.get("secret_file"):
            raise ConfigError("kv_connector_extra_config.secret_file is required")
        try:
            settings = cls.model_validate(extra)
        except ValidationError as exc:
            raise ConfigError("kv_connector_extra_config: " + "; ".join(format_errors(exc))) from None
        value = settings.resolve_secret(Path("/"))
        return settings.model_copy(update={"secret": SecretStr(value or ""), "secret_file": None})
