"""Transport backends, registered by name in one place and imported only when used.

`grpc` is the portable path; `shm` moves bytes through shared memory on one host; `collective`
through a torch.distributed point-to-point group per producer/consumer pair (gloo / NCCL / HCCL);
`mooncake` with Mooncake's transfer engine (the consumer reads the producer's cache, TCP or RDMA).
All of them use the gRPC service for control. `serve_backends` puts every backend a producer
offers on its one control server; the consumer picks one per producer (selection.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdcluster.kv_transfer.transports.base import Transport, TransportServer

if TYPE_CHECKING:
    from pdcluster.kv_transfer.producer import KVProducer
    from pdcluster.kv_transfer.settings import KVTransferSettings

_REGISTRY: dict[str, str] = {}


def register_transport(name: str, target: str) -> None:
    """Register `module:Class` under `name`; a name may be registered once."""
    if name in _REGISTRY:
        raise ValueError(f"KV transport {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = target


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def create_transport(name: str, settings: KVTransferSettings, device: str = "cpu") -> Transport:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; available: {', '.join(available_transports())}") from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(settings, device)


def serve_backends(
    names: Sequence[str],
    settings: KVTransferSettings,
    producer: KVProducer,
    host: str,
    port: int,
    device: str = "cpu",
) -> TransportServer:
    """One control server on host:port that serves every backend in `names`."""
    from pdcluster.kv_transfer.transports.grpc_transport import GrpcServer

    extensions = []
    try:
        for name in names:
            extension = create_transport(name, settings, device).server_extension(producer, host)
            if extension is not None:
                extensions.append(extension)
    except BaseException:  # a backend that cannot start: those built so far hold threads, sockets
        for extension in extensions:
            extension.close()
        raise
    return GrpcServer(producer, host, port, settings, extensions, offers=names)  # closes them if it fails


register_transport("grpc", "pdcluster.kv_transfer.transports.grpc_transport:GrpcTransport")
register_transport("shm", "pdcluster.kv_transfer.transports.shm:ShmTransport")
register_transport("collective", "pdcluster.kv_transfer.transports.collective:CollectiveTransport")
register_transport("mooncake", "pdcluster.kv_transfer.transports.mooncake:MooncakeTransport")
