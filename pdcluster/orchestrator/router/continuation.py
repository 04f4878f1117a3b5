"""First token from the prefill: stream it at once, let the decode replica continue after it.

The prefill replica computes the whole prompt and samples the first token anyway (max_tokens=1).
Classic P/D drops that token and the decode replica samples it again after the KV handoff, so the
client's first token waits for the handoff, a decode step and a second HTTP hop. With
`router.first_token_from_prefill` (default on) the router streams the prefill's token as soon as
the prefill answers and asks the decode replica to continue *after* it: a completions request
over the exact token ids, prompt plus that token, one token fewer to generate. The prompt's KV
is pulled as before (the producer computed exactly those prompt tokens); decode computes the one
new position. No token reaches the client later than on the classic path; the first one arrives
a handoff earlier.

With `router.decode_ahead` (default on) the continuation does not wait for the prefill's answer:
it leaves with the prefill request, over the prompt's token ids as the router tokenized them
(`ahead_body`), carrying a key instead of a lease (kv_transfer/params.AwaitParams). The decode
engine admits it, allocates its blocks, and its connector finds the lease and the prefill's
first token by that key at the producer (kv_transfer/ahead.py), appends the token to the prompt
and computes from there: the lease and the token reach decode without passing through the
router and decode's HTTP front end. The router streams that answer only once the prefill's own
answer shows the same prompt ids and producer; otherwise it is dropped for the path above.

Only requests whose meaning survives the split take this path: streaming, one choice, and only
fields that mean the same for the continuation (`CONTINUABLE_FIELDS`), with the model's own
generation defaults (generation_config.json) counted as if the client had sent them. Anything
else takes the classic path: stop strings (one could straddle the two replicas' texts),
logprobs, echo, tools, response formats, penalties over output tokens, a seed (the continuation
would draw its second token from a fresh generator: another text than one engine gives); and so
does a prefill that returned an incomplete UTF-8 character or computed fewer tokens than the
prompt (MTP back-off). A prefill that stopped at its first token (EOS, a stop token) is the whole
answer: the router streams it and no decode replica sees the request (`stopped`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pdcluster.kv_transfer.params import KVParams

CONTINUATION_PATH = "/v1/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions

# Request fields with the same meaning for the continuation (a completions request over token
# ids that generates one token fewer); `max_tokens`-like limits and `min_tokens` are adjusted.
CONTINUABLE_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "user",
        "n",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "request_id",  # the client's name for the request (as X-Request-Id): no token depends on it
    }
)
# Other fields are fine while they are off (clients send defaults): "empty" None/""/[], "zero"
# None/0, "false" None/False (completions' logprobs=0 is not off: it returns a logprob).
NEUTRAL_WHEN = {
    "stop": "empty",
    "presence_penalty": "zero",
    "frequency_penalty": "zero",
    "logprobs": "false",
    "echo": "false",
}
_PROMPT_FIELD = {"completions": "prompt", "chat": "messages"}


# generation_config.json keys vLLM takes as request defaults, by the request field they stand for.
GENERATION_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}


def request_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """What the model's generation_config.json makes a request's defaults (vLLM applies them to
    fields the client did not set)."""
    return {field: generation_config[key] for key, field in GENERATION_DEFAULTS.items() if key in generation_config}


def with_defaults(body: dict[str, Any], kind: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The request as the engine will run it: the client's fields over the model's defaults
    (a completions request's max_tokens defaults to 16 in the protocol itself, so the model's
    max_new_tokens stands in for chat requests only)."""
    if kind == "completions":
        defaults = {key: value for key, value in defaults.items() if key != "max_tokens"}
    return {**defaults, **{key: value for key, value in body.items() if value is not None}}


def output_limit(body: dict[str, Any], kind: str) -> int | None:
    """The client's bound on generated tokens (None: up to the context length)."""
    if kind == "chat":
        limit = body.get("max_completion_tokens")
        return body.get("max_tokens") if limit is None else limit
    return body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)


def _neutral(key: str, value: Any) -> bool:
    off = NEUTRAL_WHEN.get(key)
    if off is None:
        return False
    if value is None:
        return True
    if off == "false":
        return value is False
    if off == "zero":
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0
    return value in ("", [])


def continuable(
    body: dict[str, Any], kind: str, defaults: dict[str, Any] | None = None, max_model_len: int | None = None
) -> bool:
    """Can this request take its first token from the prefill (see the module docstring)?
    `defaults`: request_defaults() of the model's generation config. A chat without an output
    limit runs to the context length: its continuation (a completions request, whose missing
    limit is 16) needs `max_model_len` to say how far."""
    body = with_defaults(body, kind, defaults or {})
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    for key, value in body.items():
        if key == _PROMPT_FIELD[kind] or value is None or _neutral(key, value):
            continue  # a null field is the field's default
        if key not in CONTINUABLE_FIELDS:
            return False
    limit = output_limit(body, kind)
    if limit is not None and limit < 2:
        return False
    if limit is None and not max_model_len:
        return False
    if kind == "completions":
        prompt = body.get("prompt")
        single_text = isinstance(prompt, str)
        single_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        return single_text or single_ids
    return True


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    text: str
    prompt_ids: list[int]
    response_id: str
    created: int
    model: str


def first_token(answer: dict[str, Any], kind: str, lease: KVParams) -> FirstToken | None:
    """The prefill's first token, if the decode replica can continue after it; else None."""
    choices = answer.get("choices") or []
    if len(choices) != 1 or choices[0].get("finish_reason") != "length":
        return None  # stopped at its first token (EOS, stop token): `stopped` answers it
    choice = choices[0]
    ids = choice.get("token_ids")
    if kind == "completions":
        prompt_ids, text = choice.get("prompt_token_ids"), choice.get("text")
    else:
        prompt_ids, text = answer.get("prompt_token_ids"), (choice.get("message") or {}).get("content")
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(prompt_ids, list) and prompt_ids):
        return None
    if not isinstance(text, str) or not text or text.endswith("\ufffd"):
        # A character split across tokens: vLLM holds its first bytes back ("", or U+FFFD from
        # a slow tokenizer), and a continuation over them decodes them apart (the client got
        # the whole prompt's text again, or U+FFFD). The classic path decodes them together.
        return None
    if lease.remote_num_tokens != len(prompt_ids):
        return None  # the producer computed a shorter prompt (MTP back-off)
    return FirstToken(
        token_id=int(ids[0]),
        text=text,
        prompt_ids=[int(t) for t in prompt_ids],
        response_id=str(answer.get("id", "")),
        created=int(answer.get("created", 0)),
        model=str(answer.get("model", "")),
    )


def decode_body(
    body: dict[str, Any],
    kind: str,
    first: FirstToken,
    kv_params: dict[str, Any],
    defaults: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The continuation request for the decode replica (sent to CONTINUATION_PATH)."""
    prompt = [*first.prompt_ids, first.token_id]
    return _continuation_body(body, kind, prompt, len(prompt), kv_params, defaults, max_model_len)


def tokens_left(context_len: int, max_model_len: int | None) -> int | None:
    """How many tokens may follow a context of this many tokens (the prompt and the tokens so
    far) before the context length: what a request without an output limit generates, as vLLM
    runs such a chat (None: the context length is unknown)."""
    return None if not max_model_len else max_model_len - context_len


def room_after(context_len: int, max_model_len: int | None) -> bool:
    """Whether a context of this many tokens leaves room for one more (unknown length: assumed).
    A continuation over a prompt one short of the context length would be refused (no token
    left to generate): such a request takes the classic path, where token 1 is its whole answer."""
    left = tokens_left(context_len, max_model_len)
    return left is None or left > 0


def ahead_body(
    body: dict[str, Any],
    kind: str,
    prompt_ids: list[int],
    kv_params: dict[str, Any],
    defaults: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The continuation sent with the prefill request (router.decode_ahead): over the prompt
    alone, the first token to come with the lease (`kv_params`: AwaitParams.to_dict())."""
    # the first token joins the prompt on decode (the connector appends it)
    return _continuation_body(body, kind, list(prompt_ids), len(prompt_ids) + 1, kv_params, defaults, max_model_len)


def _continuation_body(
    body: dict[str, Any],
    kind: str,
    prompt: list[int],
    context_len: int,
    kv_params: dict[str, Any],
    defaults: dict[str, Any] | None,
    max_model_len: int | None,
) -> dict[str, Any]:
    body = with_defaults(body, kind, defaults or {})
    out = {
        key: value
        for key, value in body.items()
        if key in CONTINUABLE_FIELDS and key not in ("max_tokens", "max_completion_tokens", "min_tokens", "n")
    }
    limit = output_limit(body, kind)
    out["max_tokens"] = tokens_left(context_len, max_model_len) if limit is None else limit - 1
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - 1)
    # the token ids let the stream move to another decode replica if this one fails (migration.py)
    out.update(prompt=prompt, stream=True, kv_transfer_params=kv_params, return_token_ids=True)
    return out


# Top-level fields of a continuation's chunks kept as they are (vLLM puts the fingerprint on the
# last chunk, speculative decoding's metrics on the usage chunk).
CARRIED_FIELDS = ("system_fingerprint", "metrics")
# What the router asks a decode replica for (`return_token_ids`) and the client never gets (a
# request that asks for them itself takes the classic path: not a continuable field).
TOKEN_FIELDS = ("token_ids", "prompt_token_ids", "prompt_text")


def _event(first: FirstToken, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return _chunk(first.response_id, first.created, first.model, kind, choices)


def _chunk(response_id: str, created: int, model: str, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def stopped(answer: dict[str, Any], kind: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A prefill answer that stopped at its first token (EOS, a stop token) as the stream vLLM
    sends for it: the whole answer, so the router ends the request there (None: it did not stop).
    Handing it to decode instead would sample token 1 again: a sampled request would end at
    token 1 with the square of its probability (the prefill's draw and decode's both stopping).
    The prefill request asked its producer to keep no lease for it (params.STOP_ENDS)."""
    choices = answer.get("choices")
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
        return None
    choice = choices[0]
    if choice.get("finish_reason") != "stop":
        return None
    end = {"finish_reason": "stop", "stop_reason": choice.get("stop_reason")}
    chunk = functools.partial(
        _chunk, str(answer.get("id", "")), int(answer.get("created", 0)), str(answer.get("model", "")), kind
    )
    if kind == "chat":
        message = choice.get("message") or {}
        # what the message says besides its role (content; reasoning where a parser split it)
        delta = {key: value for key, value in message.items() if key != "role" and value not in (None, "", [])}
        delta.setdefault("content", "")
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        events = [chunk([role]), chunk([{"index": 0, "delta": delta, "logprobs": None, **end}])]
        generated = [0, 1]
    else:
        events = [chunk([{"index": 0, "text": choice.get("text") or "", "logprobs": None, **end}])]
        generated = [1]
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    options = body.get("stream_options") or {}
    if options.get("include_usage") and options.get("continuous_usage_stats"):
        prompt = usage.get("prompt_tokens", 0)
        for event, n in zip(events, generated):
            event["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n}
    last = events[-1]
    if options.get("include_usage"):
        last = chunk([])
        last["usage"] = usage
        events.append(last)
    for key in CARRIED_FIELDS:  # on the last chunk, as vLLM puts them (metrics: on usage only)
        if answer.get(key) is not None and (key != "metrics" or options.get("include_usage")):
            last[key] = answer[key]
    return events


def prelude(first: FirstToken, kind: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that stream the first token (chat: the role chunk first, as vLLM does), with
    usage when the client asked for it on every chunk (`continuous_usage_stats`)."""
    if kind == "chat":
        events = [
            _event(
                first,
                kind,
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            ),
            _event(
                first, kind, [{"index": 0, "delta": {"content": first.text}, "logprobs": None, "finish_reason": None}]
            ),
        ]
    else:
        events = [
            _event(
                first,
                kind,
                [{"index": 0, "text": first.text, "logprobs": None, "finish_reason": None, "stop_reason": None}],
            )
        ]
    options = body.get("stream_options") or {}
    if options.get("include_usage") and options.get("continuous_usage_stats"):
        prompt = len(first.prompt_ids)
        for event, generated in zip(events, [0, 1] if kind == "chat" else [1]):
            event["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + generated,
                "completion_tokens": generated,
            }
    return events


def rewrite(
    event: dict[str, Any], kind: str, first: FirstToken, generated: int = 1, ahead: bool = False
) -> dict[str, Any]:
    """One (parsed, not an error) event of a continuation after `generated` tokens the client
    already has, as the client's request would have produced it: the first response's id, the
    chat format for chat requests, usage counting those tokens (`ahead`: the continuation's
    prompt did not hold them, ahead_body), and none of the TOKEN_FIELDS."""
    usage = event.get("usage")
    if usage:
        if ahead:
            usage["total_tokens"] = usage.get("total_tokens", 0) + generated
        else:
            usage["prompt_tokens"] = usage.get("prompt_tokens", generated) - generated
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + generated
    choices = event.get("choices") or []
    if kind == "chat":
        choices = [
            {
                "index": c.get("index", 0),
                "delta": {"content": c.get("text", "")},
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
            }
            for c in choices
        ]
    else:
        choices = [{key: value for key, value in c.items() if key not in TOKEN_FIELDS} for c in choices]
    out = _event(first, kind, choices)
    if usage:
        out["usage"] = usage
    for key in CARRIED_FIELDS:  # what vLLM's chunks of either kind carry, as it sent them
        if key in event:
            out[key] = event[key]
    return out
