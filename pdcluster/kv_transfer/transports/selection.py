"""Which backend a P/D pair uses, decided by the consumer, where both endpoints are known.

The producer's KV server tells, in the handshake of each connection (protocol.ProducerInfo), its
node identity, its KV cache's device kind and the backends it offers (`offered_backends`). The
consumer's `kv_transfer.backend` then decides (`choose_backend`):
  auto        shm on the same node; else mooncake when both engines have Mooncake's transfer
              engine (host caches read in place, device caches through host slots); else
              collective when both caches are on the same kind of accelerator (NCCL / HCCL);
              else grpc. Mooncake and collective backends carry KV in clear: with
              `kv_transfer.tls` (KV channels to be encrypted) auto keeps to grpc
  explicit    that backend, refused with both sides' values if the producer does not offer it
              (or, for shm, is on another node)
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

from pdcluster.errors import KVTransferError

BACKEND_CHOICES = ("auto", "grpc", "shm", "collective", "mooncake")
ACCELERATORS = ("cuda", "npu")  # device kinds with a collective backend worth picking on auto


@lru_cache(maxsize=1)
def node_id() -> str:
    """This host's identity for 'same node': hostname, boot id and IPC namespace (the things two
    processes must share for /dev/shm and cross-memory copies to reach each other)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    try:
        ipc = str(os.stat("/proc/self/ns/ipc").st_ino)
    except OSError:
        ipc = "-"
    return f"{socket.gethostname()}/{boot}/{ipc}"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def offered_backends(configured: str, bind_host: str = "0.0.0.0") -> list[str]:
    """What a producer configured with `configured` serves (control is always gRPC). On auto,
    mooncake only where its engine runs and the KV server is reachable from other nodes:
    Mooncake's transfer engine listens on every interface (it has no bind setting), so a KV
    server bound to loopback (one node: shm serves it) opens no Mooncake port."""
    if configured not in BACKEND_CHOICES:
        raise KVTransferError(f"kv_transfer backend {configured!r}; choose one of {BACKEND_CHOICES}")
    if configured != "auto":
        return [configured]
    from pdcluster.kv_transfer.transports.mooncake_engine import unavailable

    offers = ["grpc", "shm", "collective"]
    if bind_host not in LOOPBACK and unavailable() is None:
        offers.append("mooncake")
    return offers


def choose_backend(
    configured: str,
    *,
    local_node: str,
    local_device: str,
    remote_node: str,
    remote_device: str,
    remote_offers: tuple[str, ...] | list[str],
    remote_engine: str = "prefill",
    encrypted: bool = False,
    local_offers: tuple[str, ...] | list[str] = (),
) -> str:
    """The backend this consumer uses with that producer (raises naming both sides' values).
    `encrypted`: the KV channels run TLS, so auto never picks a backend that moves KV in clear;
    `local_offers`: what this engine can run itself (offered_backends)."""
    same_node = bool(remote_node) and remote_node == local_node
    if configured == "auto":
        if same_node and "shm" in remote_offers:
            return "shm"
        if not same_node and not encrypted and "mooncake" in remote_offers and "mooncake" in local_offers:
            return "mooncake"
        same_accelerator = local_device in ACCELERATORS and remote_device == local_device
        if same_accelerator and not encrypted and "collective" in remote_offers:
            return "collective"
        if "grpc" in remote_offers:
            return "grpc"
        raise KVTransferError(
            f"no KV backend in common: producer {remote_engine} offers {list(remote_offers)} "
            f"(node {remote_node or '?'}, {remote_device or '?'}), this consumer has backend auto "
            f"(node {local_node}, {local_device})"
        )
    if configured not in remote_offers:
        raise KVTransferError(
            f"producer {remote_engine} offers KV backends {list(remote_offers)}, "
            f"this consumer is configured for {configured!r}"
        )
    if configured == "shm" and not same_node:
        raise KVTransferError(
            f"KV backend shm needs producer and consumer on one node: producer {remote_engine} is "
            f"on {remote_node or '?'}, this consumer on {local_node}"
        )
    if configured == "collective" and remote_device and remote_device != local_device:
        raise KVTransferError(
            f"KV backend collective needs one device kind: producer {remote_engine} has "
            f"{remote_device}, this consumer {local_device}"
        )
    return configured
