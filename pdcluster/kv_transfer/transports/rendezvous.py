"""A collective pair's rendezvous store, without a store port.

torch.distributed groups rendezvous through a key-value store (each rank sets its address and
reads the other's). Instead of a TCPStore (a port anyone on the network could connect to, read
and write), a pair's store is a dict in the producer's process (`PairStore`), and the consumer
reaches it only through `CollectiveStore` calls on its authenticated session (`RemoteStore`).
Both are `torch.distributed.Store` subclasses, which torch's process groups take like any store.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import grpc
import torch.distributed as dist

from pdcluster.errors import KVTransferError
from pdcluster.kv_transfer.transports.rpc import translate
from pdcluster.protos import kv_transfer_pb2 as pb

MAX_STORE_KEYS = 64  # a pair's rendezvous sets a handful of keys
MAX_STORE_VALUE = 64 << 10


class PairStore(dist.Store):
    """A pair's rendezvous store, in the producer's process (torch calls set/get/wait/check)."""

    def __init__(self, timeout: timedelta):
        super().__init__()
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._timeout = timeout.total_seconds()

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._cond:
            if key not in self._values and len(self._values) >= MAX_STORE_KEYS:
                raise KVTransferError(f"collective rendezvous store full ({MAX_STORE_KEYS} keys)")
            if len(data) > MAX_STORE_VALUE:
                raise KVTransferError(f"collective rendezvous value of {len(data)} bytes refused")
            self._values[key] = data
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values, timeout_s or self._timeout):
                raise KVTransferError(f"collective rendezvous key {key!r} not set in time")
            return self._values[key]

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            self.get(key, timeout.total_seconds() if timeout else None)

    def check(self, keys) -> bool:
        with self._cond:
            return all(key in self._values for key in keys)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()


class RemoteStore(dist.Store):
    """The consumer's view of its pair's PairStore: every set/get is a CollectiveStore call."""

    def __init__(self, client, group_key: str, timeout: timedelta):
        """`client`: the consumer's CollectiveClient (its `store_call` and `endpoint`)."""
        super().__init__()
        self._client, self._key, self._timeout = client, group_key, timeout.total_seconds()

    def _call(self, op: str, key: str, value: bytes = b"", timeout_s: float | None = None) -> bytes:
        timeout_s = timeout_s or self._timeout
        request = pb.CollectiveStoreRequest(
            group_key=self._key, op=op, key=key, value=value, timeout_ms=int(timeout_s * 1000)
        )
        try:
            reply = self._client.store_call(request, timeout=timeout_s + 5)
        except grpc.RpcError as exc:
            # torch reads a RuntimeError as a failed rendezvous
            raise RuntimeError(str(translate(exc, self._client.endpoint, f"collective store {op}"))) from None
        return reply.value

    def set(self, key: str, value) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            self._call("get", key, timeout_s=timeout.total_seconds() if timeout else None)

    def check(self, keys) -> bool:
        try:
            for key in keys:
                self._call("get", key, timeout_s=0.001)
        except RuntimeError:
            return False
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()
