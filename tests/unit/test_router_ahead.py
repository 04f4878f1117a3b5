"""The router's decode sent ahead (`decode_ahead`) and a prefill that stopped at its first token,
against stand-in replicas on real sockets (replica_stand_ins.py): a continuation leaves with its
prefill request only when a lease vouches for the prefill replica, and is streamed only if the
prefill computed what it assumed. The rest of the handoff: test_router_handoff.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdcluster.kv_transfer import params as kvp
from pdcluster.orchestrator.router import Router, RouterSettings
from tests.unit.replica_stand_ins import (
    ENGINE_TOKEN,
    PROMPT_IDS,
    StandIn,
    data,
    decode_answer,
    lease_of,
    metric,
    post,
    prefill_answer,
    resuming_decode,
    row,
    running,
)


def sent_ahead(router: Router, decode: StandIn | dict[str, StandIn], prompt: list[int]):
    """Two streamed requests through a router with decode_ahead: the first one's lease vouches for
    the prefill replica, so the second one's continuation leaves with its prefill request.
    (response, lines, prefill stand-in) of the second. `decode`: decode-0, or replicas by id."""
    prefill = StandIn(prefill_answer())
    decodes = decode if isinstance(decode, dict) else {"decode-0": decode}
    body = {"model": "tiny", "max_tokens": 4, "stream": True}

    async def scenario():
        url = await running(router, prefill, *decodes.values())
        rows = [row(rid, "decode", stand_in.url) for rid, stand_in in decodes.items()]
        router.update_replicas([row("prefill-0", "prefill", prefill.url), *rows])
        try:
            await post(url, "/v1/completions", {**body, "prompt": PROMPT_IDS})  # its lease: the voucher
            return await post(url, "/v1/completions", {**body, "prompt": prompt})
        finally:
            await router.stop()
            for stand_in in (prefill, *decodes.values()):
                stand_in.close()

    response, lines = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(r.inflight_requests == 0 for r in router.replicas.values())
    return response, lines, prefill


async def stopped_prefill(call, out):
    """A prefill that stopped at its first token (EOS, token 2): its whole answer, no lease (the
    producer keeps none for a request marked STOP_ENDS)."""
    choice = {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [2]}
    if call.path == "/v1/chat/completions":
        choice["message"] = {"role": "assistant", "content": "", "reasoning": None, "tool_calls": []}
    else:
        choice.update(text="", prompt_token_ids=PROMPT_IDS)
    usage = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    answer = {"id": "cmpl-p", "created": 1, "model": "tiny", "choices": [choice], "usage": usage}
    await out.json({**answer, "system_fingerprint": "fp", "kv_transfer_params": None})


@pytest.mark.parametrize("decode_ahead", [False, True], ids=["after-prefill", "ahead"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prefill_that_stopped_at_its_first_token_is_the_whole_answer(path, decode_ahead):
    """A stream whose prefill stopped at token 1 gets the prefill's answer as vLLM streams it, and
    decode is not asked (it would sample token 1 again: a sampled request would stop there with
    the square of its probability); a continuation sent ahead is dropped, and no prefill is
    asked again. The prefill request told its producer to keep no lease for a stop."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, decode_ahead=decode_ahead))
    prefill, decode = StandIn(prefill_answer()), StandIn(decode_answer)
    body = {"model": "tiny", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    chat = path == "/v1/chat/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT_IDS}

    async def scenario():
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        try:
            await post(url, "/v1/completions", {**body, "prompt": PROMPT_IDS})  # its lease: a voucher
            prefill.answer = stopped_prefill
            return await post(url, path, {**body, **prompt})
        finally:
            await router.stop()
            prefill.close(), decode.close()

    response, lines = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    assert "x-pdcluster-decode" not in response.headers
    end = {"logprobs": None, "finish_reason": "stop", "stop_reason": None}
    choices = [[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]]
    choices = (
        [*choices, [{"index": 0, "delta": {"content": ""}, **end}]] if chat else [[{"index": 0, "text": "", **end}]]
    )
    events = data(lines)
    assert [e["choices"] for e in events] == [*choices, []]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert events[-1]["system_fingerprint"] == "fp" and all(e["id"] == "cmpl-p" for e in events)
    assert len(prefill.posts()) == 2 and prefill.posts()[1].body["kv_transfer_params"][kvp.STOP_ENDS] is True
    # decode saw at most the continuation sent ahead (dropped: cancelled, or closed once it arrived)
    assert all(kvp.AWAIT in c.body["kv_transfer_params"] for c in decode.posts()[1:])
    assert metric(router, 'pdcluster_decode_ahead_total{outcome="dropped"}') == (decode_ahead and not chat)
    assert metric(router, 'pdcluster_first_token_source_total{role="prefill"}') == 2
    ok = [
        metric(router, f'pdcluster_requests_total{{endpoint="{kind}",outcome="ok"}}')
        for kind in ("completions", "chat")
    ]
    assert ok == ([1, 1] if chat else [2, 0])  # with the voucher's request
    assert all(r.inflight_requests == 0 for r in router.replicas.values())


@pytest.mark.parametrize("prompt, outcome", [(PROMPT_IDS, "streamed"), ([11, 12, 99], "dropped")])
def test_a_continuation_sent_ahead_is_streamed_only_if_the_prefill_computed_what_it_assumed(prompt, outcome):
    """router.decode_ahead: once a prefill replica's lease vouches for it, the continuation leaves
    with the prefill request, over the prompt ids the router knows, with the key the prefill files
    its lease under. It is streamed when the prefill's answer shows those ids; when the prefill
    computed other ids it is dropped, and the request is prefilled again, with no continuation
    ahead: the dropped one's decode engine may have pulled and released the lease filed under its
    key, so the continuation after the prefill's first token carries the fresh lease (3), never
    that one (2). (The stand-in prefill always answers PROMPT_IDS.)"""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, decode_ahead=True))
    decode = StandIn(decode_answer)
    response, lines, prefill = sent_ahead(router, decode, prompt)
    assert response.status_code == 200
    assert [c["text"] for e in data(lines) for c in e["choices"]] == [" first", " t0", " t1", " t2"]
    key = prefill.posts()[1].body["kv_transfer_params"][kvp.LEASE_KEY]
    sent = decode.posts()[1:]
    ahead = [c.body for c in sent if kvp.AWAIT in c.body["kv_transfer_params"]]
    assert [(b["prompt"], b["kv_transfer_params"][kvp.AWAIT]["key"]) for b in ahead] == [(prompt, key)]
    after = [c.body for c in sent if kvp.AWAIT not in c.body["kv_transfer_params"]]
    assert [(b["prompt"], lease_of(b)) for b in after] == ([] if outcome == "streamed" else [([*PROMPT_IDS, 42], 3)])
    assert metric(router, f'pdcluster_decode_ahead_total{{outcome="{outcome}"}}') == 1
    assert len(prefill.posts()) == (2 if outcome == "streamed" else 3)
    assert all(kvp.LEASE_KEY not in p.body["kv_transfer_params"] for p in prefill.posts()[2:])  # none ahead


def test_a_continuation_sent_ahead_that_gets_no_kv_is_replaced_by_the_one_after_the_prefill():
    """The decode engine gives up on a continuation sent ahead (its lease never came: the voucher's
    endpoint is gone, a lookup failed) and ends its stream with a kv_transfer_error before any
    token. The prefill's lease is intact, so the continuation after the prefill's first token
    goes to the decode replica instead, and the client sees one clean stream, no error."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, decode_ahead=True))

    async def no_lease_ahead(call, out):
        if kvp.AWAIT not in call.body["kv_transfer_params"]:
            await decode_answer(call, out)
            return
        error = {"message": "no lease came for a request admitted ahead", "type": "kv_transfer_error", "code": 500}
        await out.sse([f"data: {json.dumps({'error': error})}", "data: [DONE]"])

    decode = StandIn(no_lease_ahead)
    response, lines, _ = sent_ahead(router, decode, PROMPT_IDS)
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    events = data(lines)
    assert not [e for e in events if "error" in e]
    assert [c["text"] for e in events for c in e["choices"]] == [" first", " t0", " t1", " t2"]
    sent = decode.posts()[1:]
    assert [kvp.AWAIT in c.body["kv_transfer_params"] for c in sent] == [True, False]
    assert (sent[1].body["prompt"], lease_of(sent[1].body)) == ([*PROMPT_IDS, 42], 2)
    assert metric(router, 'pdcluster_decode_ahead_total{outcome="lost"}') == 1
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="ok"}') == 2


def test_a_continuation_sent_ahead_whose_decode_dies_before_its_first_event_moves_on():
    """The decode replica a continuation was sent ahead to dies before its stream's first event
    (the router was reading for it: relay.first_event). The break reaches the relay as if it had
    read it itself: the stream moves to the other decode replica, from the prefill's token."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, decode_ahead=True))

    async def dies_when_ahead(call, out):
        params = call.body.get("kv_transfer_params")
        if params is None:  # a migrated stream: computed from the prompt and the tokens sent
            await resuming_decode(call, out)
        elif kvp.AWAIT in params:
            await out.sse([], then_hang_up=True)
        else:
            await decode_answer(call, out)

    decodes = {"decode-0": StandIn(dies_when_ahead), "decode-1": StandIn(dies_when_ahead)}
    response, lines, _ = sent_ahead(router, decodes, PROMPT_IDS)
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    events = data(lines)
    assert not [e for e in events if "error" in e]
    assert [c["text"] for e in events for c in e["choices"]] == [" first", " t101", " t102", " t103"]
    assert metric(router, 'pdcluster_stream_migrations_total{outcome="ok"}') == 1
