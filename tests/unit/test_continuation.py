"""The router's first-token-from-prefill split (orchestrator/router/continuation.py): which requests may
take it, what the decode replica is asked for, and how its stream is rewritten for the client.
End to end (token-for-token equal to an aggregated engine, completions and chat): tests/e2e/
test_cluster.py."""

from __future__ import annotations

import json

import pytest

from pdcluster.kv_transfer.params import KVParams
from pdcluster.orchestrator.router import continuation as cont
from pdcluster.orchestrator.router.migration import Progress, resume_body

BASE = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "stream": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8, "stream": True}


@pytest.mark.parametrize(
    ("change", "kind", "expected"),
    [
        ({}, "completions", True),
        ({"stream": False}, "completions", False),
        ({"n": 2}, "completions", False),
        ({"max_tokens": 1}, "completions", False),  # the prefill's token is the whole answer
        ({"stop": ["\n"]}, "completions", False),  # a stop string could straddle the two texts
        ({"stop": []}, "completions", True),
        ({"logprobs": 0}, "completions", False),  # 0 still returns the sampled token's logprob
        ({"logprobs": None, "echo": False, "presence_penalty": 0.0}, "completions", True),
        ({"frequency_penalty": 0.5}, "completions", False),
        ({"suffix": "x"}, "completions", False),
        ({"prompt": ["a", "b"]}, "completions", False),  # two prompts
        ({"prompt": [1, 2, 3]}, "completions", True),
        ({"top_p": 0.9, "stream_options": {"include_usage": True}}, "completions", True),
        # A seeded continuation draws its second token from a fresh generator: another text.
        ({"seed": 7}, "completions", False),
        # The client's own name for its request (vLLM's body field, as X-Request-Id) changes no
        # token: it took the classic path, and its stream could not migrate.
        ({"request_id": "my-request-7"}, "completions", True),
    ],
)
def test_which_completions_continue(change, kind, expected):
    assert cont.continuable({**BASE, **change}, kind) is expected


def test_which_chats_continue():
    assert cont.continuable(CHAT, "chat")
    assert cont.continuable({**CHAT, "tools": None}, "chat")  # null is the default
    assert not cont.continuable({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat")
    assert not cont.continuable({**CHAT, "response_format": {"type": "json_object"}}, "chat")
    assert not cont.continuable({**CHAT, "max_completion_tokens": 1, "max_tokens": 50}, "chat")
    unbounded = {k: v for k, v in CHAT.items() if k != "max_completion_tokens"}
    # no output limit: runs to the context length, which the continuation must be told
    assert cont.continuable(unbounded, "chat", max_model_len=1024)
    assert not cont.continuable(unbounded, "chat")


def test_the_models_generation_defaults_count_as_if_sent():
    """vLLM applies generation_config.json to fields a client leaves out: the router decides on
    the request as the engines will run it."""
    defaults = cont.request_defaults({"presence_penalty": 0.3, "max_new_tokens": 1, "eos_token_id": 0})
    assert defaults == {"presence_penalty": 0.3, "max_tokens": 1}
    assert not cont.continuable(BASE, "completions", defaults)  # a penalty over output tokens
    assert cont.continuable({**BASE, "presence_penalty": 0}, "completions", defaults)  # the client's own
    chat = {k: v for k, v in CHAT.items() if k != "max_completion_tokens"}
    assert cont.continuable(chat, "chat", {}, max_model_len=1024)
    assert not cont.continuable(chat, "chat", {"max_tokens": 1}, max_model_len=1024)  # the model's default: one token
    # completions' max_tokens defaults to 16 in the protocol itself, whatever the model says
    assert cont.continuable({k: v for k, v in BASE.items() if k != "max_tokens"}, "completions", {"max_tokens": 1})
    lease = KVParams("p", "r", ("127.0.0.1:1",), (0,), 3, 1e10)
    first = cont.first_token(prefill_answer("chat"), "chat", lease)
    assert cont.decode_body(chat, "chat", first, {}, {"max_tokens": 10})["max_tokens"] == 9


def prefill_answer(kind: str, text: str = "    return", finish: str = "length", prompt_ids=(11, 12, 13)) -> dict:
    choice = {"index": 0, "finish_reason": finish, "token_ids": [42]}
    answer = {"id": "cmpl-p", "created": 1700000000, "model": "tiny", "choices": [choice]}
    if kind == "completions":
        choice.update(text=text, prompt_token_ids=list(prompt_ids))
    else:
        choice["message"] = {"role": "assistant", "content": text}
        answer["prompt_token_ids"] = list(prompt_ids)
    return answer


def lease(num_tokens: int = 3) -> KVParams:
    return KVParams("prefill-0", "p-1", ("127.0.0.1:1",), (0,), num_tokens, 1e10)


def test_first_token_only_when_decode_can_continue_after_it():
    params = lease()
    for kind in ("completions", "chat"):
        first = cont.first_token(prefill_answer(kind), kind, params)
        assert first is not None and (first.token_id, first.text, first.prompt_ids) == (42, "    return", [11, 12, 13])
        assert cont.first_token(prefill_answer(kind, finish="stop"), kind, params) is None  # EOS first
        assert cont.first_token(prefill_answer(kind, text="\ufffd"), kind, params) is None  # half a character
        assert cont.first_token(prefill_answer(kind, text=""), kind, params) is None  # held back by vLLM
        assert cont.first_token(prefill_answer(kind), kind, lease(2)) is None  # MTP back-off


def test_decode_body_continues_after_the_first_token_with_one_token_less():
    first = cont.first_token(prefill_answer("completions"), "completions", lease())
    params = lease().to_dict()
    body = cont.decode_body({**BASE, "min_tokens": 4, "top_k": 3}, "completions", first, params)
    assert body["prompt"] == [11, 12, 13, 42]
    assert (body["max_tokens"], body["min_tokens"], body["top_k"], body["kv_transfer_params"]) == (7, 3, 3, params)
    default = cont.decode_body({k: v for k, v in BASE.items() if k != "max_tokens"}, "completions", first, params)
    assert default["max_tokens"] == cont.COMPLETIONS_DEFAULT_MAX_TOKENS - 1
    chat = {k: v for k, v in CHAT.items() if k != "max_completion_tokens"}
    unbounded = cont.decode_body(chat, "chat", first, params, max_model_len=1024)
    assert "messages" not in unbounded


def test_a_chat_without_an_output_limit_continues_to_the_context_length():
    """vLLM runs a chat without max_tokens up to the context length; its continuation is a
    completions request, whose missing max_tokens vLLM makes 16 (the stream stopped after 17
    tokens). It carries what is left of the context, as vLLM itself reads it."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    chat = {k: v for k, v in CHAT.items() if k != "max_completion_tokens"}
    first = cont.first_token(prefill_answer("chat"), "chat", lease())
    for body in (
        cont.decode_body(chat, "chat", first, lease().to_dict(), max_model_len=1024),
        cont.ahead_body(chat, "chat", [11, 12, 13], {}, max_model_len=1024),
    ):
        assert CompletionRequest(**{**body, "model": "tiny"}).max_tokens == 1024 - 4  # prompt 3 + token 1
    # a stream that moves to another decode replica after 3 tokens (migration.py), the same way
    resumed = resume_body(chat, "chat", Progress([11, 12, 13], [42, 43, 44]), {}, max_model_len=1024)
    assert CompletionRequest(**{**resumed, "model": "tiny"}).max_tokens == 1024 - 6
    assert not cont.room_after(1024, 1024) and cont.room_after(1023, 1024) and cont.room_after(5000, None)


def decode_chunk(**extra) -> dict:
    """A chunk of decode's continuation stream (a completions request), as vLLM sends it."""
    choice = {"index": 0, "text": " x", "finish_reason": "length", "stop_reason": None}
    return {"id": "cmpl-d", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice], **extra}


def test_a_continuations_fingerprint_and_metrics_reach_the_client():
    first = cont.first_token(prefill_answer("chat"), "chat", lease())
    last = decode_chunk(system_fingerprint="vllm-0.32.0-ab", metrics={"speculative_decoding": {"num_drafts": 3}})
    for kind in ("chat", "completions"):
        out = cont.rewrite(json.loads(json.dumps(last)), kind, first)
        assert (out["system_fingerprint"], out["metrics"]) == (last["system_fingerprint"], last["metrics"])


def test_continuation_stream_reads_as_the_clients_own_request():
    first = cont.first_token(prefill_answer("chat"), "chat", lease())
    head = cont.prelude(first, "chat", CHAT)
    assert [e["choices"][0]["delta"] for e in head] == [{"role": "assistant", "content": ""}, {"content": "    return"}]
    assert all("usage" not in e for e in head)
    continuous = {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    counted = [e["usage"] for e in cont.prelude(first, "chat", continuous)]
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in counted] == [(3, 0), (3, 1)]
    chunk = decode_chunk()
    out = cont.rewrite(json.loads(json.dumps(chunk)), "chat", first)
    assert (out["id"], out["object"]) == ("cmpl-p", "chat.completion.chunk")
    assert out["choices"] == [
        {"index": 0, "delta": {"content": " x"}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    usage = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}
    assert cont.rewrite(usage, "chat", first)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
    }
    completions = cont.first_token(prefill_answer("completions"), "completions", lease())
    out = cont.rewrite(json.loads(json.dumps(chunk)), "completions", completions)
    assert (out["id"], out["object"], out["choices"]) == ("cmpl-p", "text_completion", chunk["choices"])


def test_the_continuation_sent_ahead_is_over_the_prompt_and_counts_the_first_token_as_output():
    """router.decode_ahead: the continuation leaves before the first token is known, so it is
    over the prompt alone (decode appends the token when its lease comes) and its usage, which
    counts no first token, gets it added as an output token."""
    first = cont.first_token(prefill_answer("completions"), "completions", lease())
    params = {"pdcluster_await": {"key": "k"}}
    body = cont.ahead_body({**BASE, "min_tokens": 4}, "completions", [11, 12, 13], params)
    assert body["prompt"] == [11, 12, 13]
    assert (body["max_tokens"], body["min_tokens"], body["kv_transfer_params"]) == (7, 3, params)
    usage = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}
    assert cont.rewrite(usage, "completions", first, ahead=True)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
    }
