"""Transport backends, registered by name in one place and imported only when used.

`grpc` is the portable default. Later backends (`shm` for same-host, `collective` for
HCCL/NCCL/gloo point-to-point) register here the same way.
"""

from __future__ import annotations

import importlib

from pdcluster.kv_transfer.transports.base import Transport, TransportSettings

_REGISTRY: dict[str, str] = {}


def register_transport(name: str, target: str) -> None:
    """Register `module:Class` under `name`; a name may be registered once."""
    if name in _REGISTRY:
        raise ValueError(f"KV transport {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = target


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def create_transport(name: str, settings: TransportSettings) -> Transport:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; available: {', '.join(available_transports())}"
        ) from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(settings)


register_transport("grpc", "pdcluster.kv_transfer.transports.grpc_transport:GrpcTransport")
