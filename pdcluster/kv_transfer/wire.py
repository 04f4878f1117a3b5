"""Copy-free encoding of `KVChunk` (protos/kv_transfer.proto), the message that carries KV bytes.

The generic protobuf path copies a chunk's payload three times (tensor -> bytes -> message ->
serialized string) and again on parse. These functions produce and read the exact protobuf wire
encoding of `KVChunk{header: ChunkHeader, data: bytes}` with one join on the sending side and a
zero-copy memoryview on the receiving side. Any protobuf implementation reads what we write, and
we read what any implementation writes (unknown fields are skipped); tests/unit/test_wire.py
checks both directions against the generated classes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_WT_VARINT = 0
_WT_I64 = 1
_WT_LEN = 2
_WT_I32 = 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint in KVChunk")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long in KVChunk")


def _fields(buf: memoryview):
    """Yield (field number, wire type, value) where value is an int or a memoryview."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wtype = key >> 3, key & 7
        if wtype == _WT_VARINT:
            value, pos = _read_varint(buf, pos)
        elif wtype == _WT_LEN:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated field in KVChunk")
            value, pos = buf[pos : pos + n], pos + n
        elif wtype == _WT_I64:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wtype == _WT_I32:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wtype} in KVChunk")
        yield field, wtype, value


@dataclass(frozen=True)
class ChunkHeader:
    layer_index: int
    first_block: int
    num_blocks: int

    def encode(self) -> bytes:
        out = b""
        # proto3: zero-valued scalars are omitted, as the reference serializer does.
        for number, value in ((1, self.layer_index), (2, self.first_block), (3, self.num_blocks)):
            if value:
                out += _varint(number << 3 | _WT_VARINT) + _varint(value)
        return out

    @classmethod
    def decode(cls, buf: memoryview) -> ChunkHeader:
        values = {1: 0, 2: 0, 3: 0}
        for field, wtype, value in _fields(buf):
            if field in values and wtype == _WT_VARINT:
                values[field] = value
        return cls(values[1], values[2], values[3])


_TAG_HEADER = _varint(1 << 3 | _WT_LEN)
_TAG_DATA = _varint(2 << 3 | _WT_LEN)


def encode_chunk(header: ChunkHeader, data: memoryview | bytes) -> bytes:
    """Serialized KVChunk; the payload is copied once, into the returned bytes."""
    head = header.encode()
    parts = [_TAG_HEADER, _varint(len(head)), head]
    if len(data):
        parts += [_TAG_DATA, _varint(len(data)), data]
    return b"".join(parts)


# CPython C API: a bytes object with uninitialized contents, filled by its creator before it is
# shared (the documented way C code builds bytes). grpcio only sends `bytes`; building the
# message in place saves one full copy of every chunk on the producer.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def allocate_chunk(header: ChunkHeader, nbytes: int) -> tuple[bytes, memoryview]:
    """A serialized KVChunk whose `nbytes` payload is still to be written through the view.

    The caller must fill the whole view before the message is used; the result is then the
    same bytes encode_chunk(header, payload) returns.
    """
    head = header.encode()
    prefix = _TAG_HEADER + _varint(len(head)) + head
    if nbytes:
        prefix += _TAG_DATA + _varint(nbytes)
    message = _new_bytes(None, len(prefix) + nbytes)
    address = _bytes_data(message)
    ctypes.memmove(address, prefix, len(prefix))
    payload = (ctypes.c_char * nbytes).from_address(address + len(prefix))
    return message, memoryview(payload).cast("B")


def decode_chunk(raw: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parse a serialized KVChunk; the payload is a view into `raw` (no copy)."""
    header, data = ChunkHeader(0, 0, 0), memoryview(b"")
    for field, wtype, value in _fields(memoryview(raw)):
        if wtype != _WT_LEN:
            continue
        if field == 1:
            header = ChunkHeader.decode(value)
        elif field == 2:
            data = value
    return header, data
