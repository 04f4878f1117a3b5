"""What a replica is sent for a client's request: the prefill pass's body, and the body of the
replica whose answer the client gets (the decode replica's continuation: continuation.py)."""

from __future__ import annotations

from typing import Any

from pdcluster.kv_transfer import params as kvp

# Fields of the client's request that the prefill (one token, not streamed) must not get.
PREFILL_DROPS = ("stream_options", "logprobs", "top_logprobs", "echo")


def prefill_body(body: dict[str, Any], kind: str, continuing: bool, lease_key: str | None) -> dict[str, Any]:
    """The prefill pass: one token, not streamed, its KV kept for a decode replica (under
    `lease_key` when a continuation went ahead). `continuing`: the first token goes to the
    client, with its ids; a stop at it is the whole answer (continuation.stopped), so the
    producer keeps no lease for one."""
    out = {key: value for key, value in body.items() if key not in PREFILL_DROPS}
    params = dict(kvp.ASK_PREFILL)
    if continuing:
        params[kvp.STOP_ENDS] = True
    if lease_key is not None:
        params[kvp.LEASE_KEY] = lease_key
    out.update(stream=False, max_tokens=1, kv_transfer_params=params)
    if kind == "chat":
        out["max_completion_tokens"] = 1
    if out.get("min_tokens"):
        out["min_tokens"] = 1  # the one token still may not end the answer (EOS masked)
    if continuing:
        out["return_token_ids"] = True
    return out


def answer_body(body: dict[str, Any], lease: dict[str, Any] | None, tracked: bool) -> dict[str, Any]:
    """What the replica that answers gets: the client's request, the lease if there is one, and
    the token ids a migration continues from when the stream may migrate (`tracked`)."""
    out = body if lease is None else {**body, "kv_transfer_params": lease}
    return {**out, "return_token_ids": True} if tracked else out
