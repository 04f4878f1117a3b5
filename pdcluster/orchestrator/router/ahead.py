"""A continuation sent with its prefill request (router.decode_ahead; continuation.py).

The decode request leaves with the prefill request, over the prompt ids the router computed,
carrying a random key instead of a lease (kv_transfer/params.AwaitParams); the prefill request
asks for its lease to be filed under the same key. Its answer is streamed only if the prefill's
own answer shows that it assumed right: the same prompt ids, the same producer its voucher
names. Otherwise it is dropped (cancelled, or closed if its headers are in: decode aborts it)
and the continuation sent after the prefill takes its place.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.params import KVParams
from pdcluster.orchestrator.policies import ReplicaLoad
from pdcluster.orchestrator.router import continuation
from pdcluster.orchestrator.router.relay import error_outcome, settle
from pdcluster.orchestrator.router.upstream import post


@dataclass(eq=False)
class Ahead:
    """A continuation sent with its prefill request (router.decode_ahead): the key both carry,
    what it assumed (prompt ids, the producer its voucher names) and its answer on the way."""

    key: str
    prompt_ids: list[int]
    voucher: KVParams
    pending: asyncio.Future

    def matches(self, first: continuation.FirstToken | None, lease: KVParams) -> bool:
        """Did the prefill compute what this continuation assumed, on the producer it looks at?"""
        return (
            first is not None
            and first.prompt_ids == self.prompt_ids
            and lease.remote_engine_id == self.voucher.remote_engine_id
            and lease.remote_endpoints == self.voucher.remote_endpoints
        )

    def drop(self) -> None:
        """Not used: the request on its way is cancelled, an answer already in is closed (either
        way the decode engine aborts it, and its connector stops looking for the lease)."""
        if (answer := settle(self.pending)) is not None:
            asyncio.ensure_future(answer.aclose())

    @classmethod
    def send(
        cls,
        http: httpx.AsyncClient,
        decode: ReplicaLoad,
        request_id: str,
        body: Callable[[dict[str, Any]], dict[str, Any]],
        prompt_ids: list[int],
        voucher: KVParams,
        deadline: float,
    ) -> Ahead:
        """Post the continuation `body(kv_transfer_params)` to `decode` without waiting."""
        key = secrets.token_hex(kvp.KEY_CHARS // 2)
        params = kvp.AwaitParams(key, voucher, deadline).to_dict()
        pending = asyncio.ensure_future(
            post(http, decode, continuation.CONTINUATION_PATH, body(params), True, request_id)
        )
        return cls(key, list(prompt_ids), voucher, pending)


def lease_lost(first: dict[str, Any] | None) -> bool:
    """Is a continuation's first event the decode engine saying it got no KV (engine/kv_errors.py:
    the lease never came, or its pull failed under the fail policy)? Nothing of it reached the
    client, so the continuation sent after the prefill may go instead."""
    return first is not None and "error" in first and error_outcome(first["error"]) == "kv_transfer_error"


class Vouchers:
    """The latest lease of each prefill replica: it vouches for that replica's KV endpoints to a
    decode engine that looks a lease up there before the prefill answered."""

    def __init__(self) -> None:
        self._leases: dict[str, KVParams] = {}

    def learn(self, replica_id: str, lease: KVParams) -> None:
        self._leases[replica_id] = lease

    def send(
        self,
        http: httpx.AsyncClient,
        prefill: ReplicaLoad,
        decode: ReplicaLoad | None,
        request_id: str,
        body: Callable[[dict[str, Any]], dict[str, Any]],
        prompt_ids: list[int] | None,
        deadline: float,
    ) -> Ahead | None:
        """Ahead.send for a request to `prefill`, when its prompt ids are known and a lease of
        that replica vouches for it (its first request goes the usual way); else None."""
        voucher = self._leases.get(prefill.replica_id)
        if voucher is None or not prompt_ids or decode is None:
            return None
        return Ahead.send(http, decode, request_id, body, prompt_ids, voucher, deadline)
