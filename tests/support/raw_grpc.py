"""A hand-rolled gRPC client of our KV service (no pdcluster code on its side): what an intruder
on the network could send a KV server."""

from __future__ import annotations

import grpc
import pytest

from pdcluster.kv_transfer.transports.rpc import SERVICE
from pdcluster.protos import kv_transfer_pb2 as pb


def refused_raw_pull(address: str, request: pb.PullRequest, timeout: float) -> grpc.StatusCode:
    """Pull without a session; the status the server refused it with (nothing may arrive)."""
    with grpc.insecure_channel(address) as channel:
        pull = channel.unary_stream(
            f"/{SERVICE}/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.KVChunk.FromString,
        )
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in pull(request, timeout=timeout):
                received.append(chunk)
        assert received == []
        return info.value.code()
