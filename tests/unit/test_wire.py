"""wire.py must produce and read exactly the protobuf encoding of KVChunk."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.kv_transfer.wire import ChunkHeader, allocate_chunk, decode_chunk, encode_chunk
from pdcluster.protos import kv_transfer_pb2 as pb

u32 = st.integers(min_value=0, max_value=2**32 - 1)


@given(layer=u32, first=u32, count=u32, data=st.binary(max_size=4096))
def test_encoding_matches_reference_serializer(layer, first, count, data):
    reference = pb.KVChunk(
        header=pb.ChunkHeader(layer_index=layer, first_block=first, num_blocks=count), data=data
    ).SerializeToString()
    ours = encode_chunk(ChunkHeader(layer, first, count), memoryview(data))
    assert ours == reference


@given(layer=u32, first=u32, count=u32, data=st.binary(max_size=4096))
def test_decoding_reads_reference_serializer(layer, first, count, data):
    raw = pb.KVChunk(
        header=pb.ChunkHeader(layer_index=layer, first_block=first, num_blocks=count), data=data
    ).SerializeToString()
    header, payload = decode_chunk(raw)
    assert header == ChunkHeader(layer, first, count)
    assert bytes(payload) == data


def test_payload_is_a_view_not_a_copy():
    raw = encode_chunk(ChunkHeader(1, 2, 3), b"x" * 1000)
    _, payload = decode_chunk(raw)
    assert payload.obj is raw


def test_unknown_fields_are_skipped():
    raw = encode_chunk(ChunkHeader(3, 0, 1), b"abc")
    # field 9 varint 150, field 10 fixed32 - from a future protocol revision
    extra = bytes([9 << 3 | 0, 0x96, 0x01]) + bytes([10 << 3 | 5]) + b"\x00\x01\x02\x03"
    header, payload = decode_chunk(extra + raw)
    assert header == ChunkHeader(3, 0, 1)
    assert bytes(payload) == b"abc"


def test_truncated_message_is_rejected():
    raw = encode_chunk(ChunkHeader(1, 1, 1), b"abcdef")
    with pytest.raises(ValueError, match="truncated"):
        decode_chunk(raw[:-2])


@given(layer=u32, first=u32, count=u32, data=st.binary(max_size=4096))
def test_in_place_message_equals_encoded_message(layer, first, count, data):
    header = ChunkHeader(layer, first, count)
    message, payload = allocate_chunk(header, len(data))
    payload[:] = data
    assert isinstance(message, bytes)
    assert message == encode_chunk(header, data)
