"""Typed view of the connector's `kv_connector_extra_config` (what the cluster config passes).

The engine actor fills these keys from the cluster YAML's `kv_transfer` section; the secret is
passed as a file path, never inline, so it does not appear in vLLM's logged engine config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.errors import ConfigError
from pdcluster.kv_transfer.faults import FaultInjector
from pdcluster.kv_transfer.protocol import DEFAULT_CHUNK_BYTES


@dataclass(frozen=True)
class ConnectorSettings:
    transport: str = "grpc"
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    port_range: tuple[int, int] = (0, 0)  # (0, 0): an ephemeral port
    secret: str = ""
    lease_s: float = 30.0
    pull_timeout_s: float = 30.0
    release_timeout_s: float = 5.0
    lease_wait_s: float = 10.0
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pull_threads: int = 4
    model_id: str = ""
    faults: FaultInjector = field(default_factory=FaultInjector)

    @property
    def host_for_peers(self) -> str:
        return self.advertise_host or self.bind_host

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {
            "transport", "bind_host", "advertise_host", "port_range", "secret_file", "lease_s",
            "pull_timeout_s", "release_timeout_s", "lease_wait_s", "max_chunk_bytes",
            "pull_threads", "model_id", "fault_injection",
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}")
        secret_file = extra.get("secret_file")
        if not secret_file:
            raise ConfigError("kv_connector_extra_config.secret_file is required")
        try:
            secret = Path(secret_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"kv_connector_extra_config.secret_file: {exc}") from exc
        if not secret:
            raise ConfigError(f"kv_connector_extra_config.secret_file {secret_file} is empty")
        lo, hi = extra.get("port_range", (0, 0))
        return cls(
            transport=extra.get("transport", "grpc"),
            bind_host=extra.get("bind_host", "127.0.0.1"),
            advertise_host=extra.get("advertise_host"),
            port_range=(int(lo), int(hi)),
            secret=secret,
            lease_s=float(extra.get("lease_s", 30.0)),
            pull_timeout_s=float(extra.get("pull_timeout_s", 30.0)),
            release_timeout_s=float(extra.get("release_timeout_s", 5.0)),
            lease_wait_s=float(extra.get("lease_wait_s", 10.0)),
            max_chunk_bytes=int(extra.get("max_chunk_bytes", DEFAULT_CHUNK_BYTES)),
            pull_threads=int(extra.get("pull_threads", 4)),
            model_id=str(extra.get("model_id", "")),
            faults=FaultInjector.from_config(extra.get("fault_injection") or {}),
        )
