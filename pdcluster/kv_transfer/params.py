"""`kv_transfer_params`, typed: what travels between prefill, router and decode for one request.

vLLM carries this dict opaquely: the router asks a prefill for a remote decode (`ASK_PREFILL`), the
producer's connector answers with a `KVParams` of the lease it holds, and the router hands that
dict to the decode request, whose connector reads it back (`KVParams.from_dict`). Key names
follow vLLM's NIXL conventions where one exists. Only what is specific to the request travels:
what is static per producer engine (node identity, cache device, offered backends, layout) comes
from the producer's KV server in the handshake (transports/base.py, `ProducerInfo`).

A producer signs the params it hands out (`signed`: HMAC-SHA256 under a key derived from the
cluster secret, over every field); a consumer dials nothing for params that do not verify, so a
request that reaches an engine with params of its own cannot make decode dial an endpoint the
cluster did not vouch for.

Free of vLLM imports so that the router (which never loads vLLM) uses the same type.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, replace
from typing import Any

from pdcluster.keys import mac
from pdcluster.kv_transfer.settings import DAY, MIN_LEASE_S

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"

# What the router sends a prefill: compute the prompt, keep its KV for a decode elsewhere.
ASK_PREFILL: dict[str, Any] = {DO_REMOTE_DECODE: True}

# A prefill request whose stop at its first token the router answers itself (a streamed request
# that takes its first token from the prefill: router/continuation.stopped): its producer keeps no
# lease when the request stopped (EOS, a stop token), as no decode will pull it.
STOP_ENDS = "pdcluster_stop_ends"

# Decode admitted ahead of its prefill (router.decode_ahead): the router picks a random key, asks
# the prefill to file its lease under it (LEASE_KEY beside ASK_PREFILL) and sends decode an
# AwaitParams under AWAIT. Decode's connector fetches the lease, and the prefill's first token,
# from the producer by that key (LeaseTable.handout), then pulls as for any lease.
AWAIT = "pdcluster_await"
LEASE_KEY = "pdcluster_lease_key"
KEY_CHARS = 32  # hex digits of a key: 128 random bits

# Connector-private marks in a request's own params dict (never sent by clients or the router).
PULL_PLANNED = "_pdcluster_pull_planned"  # consumer: the pull (or release) is on its way
PREFILL_TRUNCATED = "_pdcluster_prefill_truncated"  # producer: MTP back-off applied


@dataclass(frozen=True)
class KVParams:
    """A producer's lease on one request's KV blocks, as the consumer needs it."""

    remote_engine_id: str
    remote_request_id: str
    remote_endpoints: tuple[str, ...]  # "host:port" of the producer's KV server, per TP rank
    remote_block_ids: tuple[int, ...]  # the leased blocks, in token order
    remote_num_tokens: int  # prompt tokens the producer computed (fewer with MTP back-off)
    remote_lease_expiry: float  # unix time after which the producer frees the blocks
    signature: str = ""  # the producer's: signed(key), hex
    # How long the producer's leases last (its kv_transfer.lease_seconds): the expiry less this is
    # when the lease was filed, and a renewal keeps the lease this long. 0: not said (params of a
    # producer from before the field), the consumer assumes its own setting (`lease_seconds_or`).
    remote_lease_seconds: float = 0.0

    def lease_seconds_or(self, default: float) -> float:
        """How long this producer's leases last; `default` where its params do not say."""
        return self.remote_lease_seconds if self.remote_lease_seconds > 0 else default

    def filed_at(self, default_lease_seconds: float) -> float:
        """When the producer filed this lease (unix time, its clock): the expiry less its lease
        (`lease_seconds_or(default_lease_seconds)`)."""
        return self.remote_lease_expiry - self.lease_seconds_or(default_lease_seconds)

    def _signed_text(self) -> str:
        fields = [
            self.remote_engine_id,
            self.remote_request_id,
            list(self.remote_endpoints),
            list(self.remote_block_ids),
            self.remote_num_tokens,
            repr(float(self.remote_lease_expiry)),  # repr round-trips a float exactly (and JSON too)
        ]
        if self.remote_lease_seconds > 0:  # absent from the text where absent from the params
            fields.append(repr(float(self.remote_lease_seconds)))
        return json.dumps(fields, separators=(",", ":"))

    def signed(self, key: bytes) -> KVParams:
        """These params with the producer's signature (key: keys.derive_key(secret, KV_PARAMS))."""
        return replace(self, signature=mac(key, "pdcluster-kv-params", self._signed_text()).hex())

    def verify(self, key: bytes) -> bool:
        """True when a producer of this cluster signed exactly these params."""
        expected = mac(key, "pdcluster-kv-params", self._signed_text()).hex()
        # As bytes: compare_digest refuses a str with other than ASCII characters (TypeError),
        # and these params come from a request: a raise here would stop the engine's step.
        return bool(self.signature) and hmac.compare_digest(self.signature.encode(), expected.encode())

    def to_dict(self) -> dict[str, Any]:
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_endpoints": list(self.remote_endpoints),
            "remote_block_ids": list(self.remote_block_ids),
            "remote_num_tokens": self.remote_num_tokens,
            "remote_lease_expiry": self.remote_lease_expiry,
            "remote_lease_seconds": self.remote_lease_seconds,
            "remote_signature": self.signature,
        }

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> KVParams:
        """Raise ValueError naming the bad key when the params cannot be used."""
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        try:
            endpoints = params["remote_endpoints"]
            blocks = params["remote_block_ids"]
            if not isinstance(endpoints, list) or not endpoints:
                raise ValueError("remote_endpoints must be a non-empty list")
            if not isinstance(blocks, list):
                raise ValueError("remote_block_ids must be a list")
            out = cls(
                remote_engine_id=str(params["remote_engine_id"]),
                remote_request_id=str(params["remote_request_id"]),
                remote_endpoints=tuple(str(e) for e in endpoints),
                remote_block_ids=tuple(_int(b) for b in blocks),
                remote_num_tokens=_int(params["remote_num_tokens"]),
                remote_lease_expiry=float(params["remote_lease_expiry"]),
                signature=str(params.get("remote_signature") or ""),
                remote_lease_seconds=float(params.get("remote_lease_seconds") or 0.0),
            )
        except KeyError as exc:
            raise ValueError(f"kv_transfer_params lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_params malformed: {exc}") from None
        if out.remote_num_tokens < 0 or any(b < 0 for b in out.remote_block_ids):
            raise ValueError("kv_transfer_params malformed: negative token count or block id")
        if out.remote_lease_seconds and not MIN_LEASE_S <= out.remote_lease_seconds <= DAY:
            # bounded as the producer's setting is (a consumer renews every sixth of it)
            raise ValueError(
                f"kv_transfer_params malformed: remote_lease_seconds must be 0 (not said) or "
                f"{MIN_LEASE_S:g} to {DAY:g}, got {out.remote_lease_seconds!r}"
            )
        return out


@dataclass(frozen=True)
class AwaitParams:
    """What a decode request admitted ahead of its prefill carries: the key its lease will be
    filed under, a lease the same producer signed earlier (the voucher: the consumer dials only
    endpoints a producer of this cluster vouched for) and the unix time to give up at."""

    key: str
    voucher: KVParams
    deadline: float

    def to_dict(self) -> dict[str, Any]:
        return {AWAIT: {"key": self.key, "voucher": self.voucher.to_dict(), "deadline": self.deadline}}

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> AwaitParams:
        """Raise ValueError naming what is wrong."""
        spec = params.get(AWAIT) if isinstance(params, dict) else None
        if not isinstance(spec, dict):
            raise ValueError(f"{AWAIT} must be an object")
        key = spec.get("key")
        if not valid_key(key):
            raise ValueError(f"{AWAIT}.key must be {KEY_CHARS} hex digits")
        try:
            deadline = float(spec["deadline"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{AWAIT}.deadline must be a unix time") from None
        return cls(key, KVParams.from_dict(spec.get("voucher")), deadline)


def valid_key(key: Any) -> bool:
    return isinstance(key, str) and len(key) == KEY_CHARS and all(c in "0123456789abcdef" for c in key)


def wants_lease_await(params: dict[str, Any] | None) -> bool:
    """A decode request admitted ahead of its prefill (AwaitParams)."""
    return bool(params) and AWAIT in params


def lease_key(params: dict[str, Any] | None) -> str:
    """The key a prefill request asks its lease to be filed under ("" when none or malformed)."""
    key = params.get(LEASE_KEY) if params else None
    return key if valid_key(key) else ""


PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"  # vLLM's scheduler adds it to a prefill's params


def prefill_cache_hit(params: Any) -> dict[str, int]:
    """vLLM's own report of the prefill's prefix-cache hit, from the prefill's answer, for the
    decode request to carry (its usage reports it as cached tokens); {} when absent."""
    cached = params.get(PREFILL_CACHED_TOKENS) if isinstance(params, dict) else None
    return {PREFILL_CACHED_TOKENS: cached} if type(cached) is int and cached >= 0 else {}


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """A prefill request: keep the KV for a consumer (the router's ASK_PREFILL)."""
    return bool(params) and bool(params.get(DO_REMOTE_DECODE))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """A decode request carrying a producer's lease."""
    return bool(params) and bool(params.get(DO_REMOTE_PREFILL))


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value
