"""Protocol constants and the KV layout both peers agree on before any block moves.

A producer and a consumer exchange their `KVLayout` at handshake (transport-independent). The
layout names the model, the block size, the tensor-parallel rank and, for every attention layer
(draft/MTP layers included), its per-block shape and dtype. `compare_layouts` refuses any
difference with a message naming both sides' values; `layout_digest` lets every later pull prove
it was made against the layout that was agreed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdcluster.errors import HandshakeError

PROTOCOL_VERSION = 3  # 3: Handouts (leases found by key); 2: challenge-response authentication


@dataclass(frozen=True)
class LayerSpec:
    name: str
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * dtype_size(self.dtype)


@dataclass(frozen=True)
class KVLayout:
    model: str
    block_size: int
    layers: tuple[LayerSpec, ...]
    tp_size: int = 1
    tp_rank: int = 0

    def layer_index(self) -> dict[str, int]:
        return {spec.name: i for i, spec in enumerate(self.layers)}

    def bytes_per_block(self) -> int:
        return sum(spec.block_bytes for spec in self.layers)


@dataclass(frozen=True)
class ProducerInfo:
    """What a producer's KV server says of itself in the handshake: its engine, its layout, and
    what the consumer needs to pick a data path (static per engine, so never per request)."""

    engine_id: str
    layout: KVLayout
    node_id: str = ""  # transports/selection.py node_id()
    device_kind: str = ""  # the KV cache's device: cpu | cuda | npu
    offers: tuple[str, ...] = ()  # backends the server serves


_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise HandshakeError(f"unsupported KV cache dtype {name!r}") from None


def layout_digest(layout: KVLayout) -> int:
    """64-bit digest over everything compare_layouts checks (order-sensitive)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{PROTOCOL_VERSION}|{layout.model}|{layout.block_size}|{layout.tp_size}".encode())
    for spec in layout.layers:
        h.update(f"|{spec.name}:{spec.dtype}:{','.join(map(str, spec.block_shape))}".encode())
    return int.from_bytes(h.digest(), "little")


def compare_layouts(local: KVLayout, remote: KVLayout, *, local_role: str, remote_role: str) -> None:
    """Raise HandshakeError naming both sides' values at the first incompatibility."""

    def refuse(what: str, mine: object, theirs: object) -> None:
        raise HandshakeError(f"KV layout mismatch on {what}: {local_role} has {mine!r}, {remote_role} has {theirs!r}")

    if local.model != remote.model:
        refuse("model", local.model, remote.model)
    if local.block_size != remote.block_size:
        refuse("block_size", local.block_size, remote.block_size)
    if local.tp_size != remote.tp_size:
        refuse("tensor_parallel_size", local.tp_size, remote.tp_size)
    local_names = [s.name for s in local.layers]
    remote_names = [s.name for s in remote.layers]
    if local_names != remote_names:
        missing = sorted(set(remote_names) - set(local_names))
        extra = sorted(set(local_names) - set(remote_names))
        detail = f" (only on {remote_role}: {missing}; only on {local_role}: {extra})"
        raise HandshakeError(
            f"KV layout mismatch on layer names{detail}: {local_role} has {len(local_names)} "
            f"layers, {remote_role} has {len(remote_names)}"
        )
    for mine, theirs in zip(local.layers, remote.layers):
        if mine.dtype != theirs.dtype:
            refuse(f"dtype of layer {mine.name}", mine.dtype, theirs.dtype)
        if mine.block_shape != theirs.block_shape:
            refuse(f"block shape of layer {mine.name}", mine.block_shape, theirs.block_shape)


def check_protocol_version(remote_version: int, *, remote_role: str) -> None:
    if remote_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"KV protocol version mismatch: this side speaks {PROTOCOL_VERSION}, {remote_role} speaks {remote_version}"
        )
