"""The router's P/D handoff against stand-in replicas on real sockets (replica_stand_ins.py): how it
recovers from each kind of replica failure, what it answers when no replica is left, that the
decode replica is chosen before any prefill, and how a relayed stream is read (tokens, errors,
a continuation rewritten). With live engines: tests/e2e/pd/test_reliability.py, handoff/."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router import Router, RouterSettings
from tests.unit.replica_stand_ins import (
    COMPLETION,
    ENGINE_TOKEN,
    PROMPT_IDS,
    StandIn,
    data,
    decode_answer,
    hang_up,
    lease_of,
    metric,
    prefill_answer,
    resuming_decode,
    row,
    running,
    token_events,
)

# -- recovery: one strategy for every phase ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_hangs_up_unanswered_gets_the_request_prefilled_again_for_another(serve, stream):
    """Reached, then gone before answering: it may have pulled (used up) the lease, so the request
    is prefilled again for a fresh one and sent to another decode replica."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    prefill, gone, live = StandIn(prefill_answer()), StandIn(hang_up), StandIn(decode_answer)
    stand_ins = {"prefill-0": prefill, "decode-gone": gone, "decode-live": live}
    response, lines = serve(router, stand_ins, {**COMPLETION, "stream": stream}, [])
    assert response.status_code == 200, lines
    assert response.headers["x-pdcluster-decode"] == "decode-live"
    assert len(prefill.posts()) == 2 and len(gone.posts()) == 1
    assert [lease_of(c.body) for c in gone.posts() + live.posts()] == [1, 2]  # a fresh lease
    text = (
        "".join(c["text"] for e in data(lines) for c in e["choices"])
        if stream
        else response.json()["choices"][0]["text"]
    )
    assert text == (" t0 t1 t2" if stream else "decoded lease 2")
    assert metric(router, 'pdcluster_retries_total{role="decode"}') == 1
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="ok"}') == 1
    # one request, one first token: counted once however many prefill passes it took (was 2)
    assert metric(router, 'pdcluster_first_token_source_total{role="decode"}') == 1


@pytest.mark.parametrize("first_token_from_prefill", [False, True])
def test_a_decode_never_reached_gets_its_lease_sent_to_another_without_a_second_prefill(
    serve, first_token_from_prefill
):
    """Nothing was sent, so the lease on the producer is intact: the same kv_transfer_params go to
    another decode replica (classic path, and a continuation after the prefill's first token)."""
    router = Router(
        RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=first_token_from_prefill)
    )
    prefill, live = StandIn(prefill_answer()), StandIn(decode_answer)
    unreachable = row("decode-dead", "decode")  # a closed port: refused
    response, lines = serve(
        router, {"prefill-0": prefill, "decode-live": live}, {**COMPLETION, "stream": True}, [unreachable]
    )
    assert response.status_code == 200, lines
    assert len(prefill.posts()) == 1
    [sent] = live.posts()
    assert lease_of(sent.body) == 1
    texts = [c["text"] for e in data(lines) for c in e["choices"]]
    assert texts == ([" first"] if first_token_from_prefill else []) + [" t0", " t1", " t2"]
    # a handoff gap only where the client's first token came from the prefill
    assert metric(router, "pdcluster_handoff_gap_seconds_count") == int(first_token_from_prefill)
    assert metric(router, 'pdcluster_retries_total{role="decode"}') == 1
    assert metric(router, 'pdcluster_retries_total{role="prefill"}') == 0


def test_several_choices_are_computed_by_decode_alone(serve):
    """n > 1: one lease would be used up by the first child's pull, so decode computes the prompt
    and its children share it; no prefill is asked."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))

    async def choices(call, out):
        await out.json({"id": "cmpl-d", "choices": [{"index": i, "text": f"c{i}"} for i in range(call.body["n"])]})

    prefill, decode = StandIn(prefill_answer()), StandIn(choices)
    response, _ = serve(router, {"prefill-0": prefill, "decode-0": decode}, {**COMPLETION, "n": 3}, [])
    assert response.status_code == 200 and [c["text"] for c in response.json()["choices"]] == ["c0", "c1", "c2"]
    assert prefill.calls == []
    [sent] = decode.posts()
    assert sent.body["n"] == 3 and "kv_transfer_params" not in sent.body


@pytest.mark.parametrize("prompt", [["def f():", "def g():"], [[11, 12], [13, 14]]], ids=["texts", "token-ids"])
def test_several_prompts_are_computed_by_decode_alone(serve, prompt):
    """A batch of prompts: vLLM answers it with the first prompt's lease only, so decode computes
    every prompt itself; no prefill is asked. (One prompt as token ids is one prompt.)"""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))

    async def choices(call, out):
        await out.json({"id": "cmpl-d", "choices": [{"index": i, "text": f"c{i}"} for i in range(2)]})

    prefill, decode = StandIn(prefill_answer()), StandIn(choices)
    response, _ = serve(router, {"prefill-0": prefill, "decode-0": decode}, {**COMPLETION, "prompt": prompt}, [])
    assert response.status_code == 200 and prefill.calls == []
    [sent] = decode.posts()
    assert sent.body["prompt"] == prompt and "kv_transfer_params" not in sent.body
    assert metric(router, 'pdcluster_route_decisions_total{path="decode"}') == 1


def test_a_pd_answer_sent_whole_gives_the_planner_its_latencies_but_not_the_clients_histograms(serve):
    """Non-streamed traffic: the client sees no first token, but the SLO planner reads the
    cluster's TTFT and ITL (it was blind to such traffic): token 1 when the prefill answered, the
    mean gap of decode's tokens after it. The client-facing histograms stay as clients saw."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))

    async def whole(call, out):
        await asyncio.sleep(0.2)  # decode computes tokens 2..5
        usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": "abcde"}], "usage": usage})

    prefill, decode = StandIn(prefill_answer()), StandIn(whole)
    assert router.metrics.slo() == {"ttft": None, "itl": None, "phase": None}
    response, _ = serve(router, {"prefill-0": prefill, "decode-0": decode}, COMPLETION, [])
    assert response.status_code == 200
    slo = router.metrics.slo()
    assert slo["ttft"] is not None and slo["phase"] is not None and slo["ttft"] >= slo["phase"]
    assert 0.2 / 4 <= slo["itl"] < 5.0  # four gaps after token 1, in the 0.2 s decode took at least
    assert metric(router, "pdcluster_ttft_seconds_count") == 0 and metric(router, "pdcluster_itl_seconds_count") == 0


@pytest.mark.parametrize("how", ["header", "body", "body-not-ascii"])
def test_the_clients_request_id_names_the_request_on_every_engine(serve, how):
    """vLLM names a request (and its answer, "cmpl-<id>") by the client's X-Request-Id, else the
    body's request_id: the router passes it on to every phase instead of its own."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    prefill, decode = StandIn(prefill_answer()), StandIn(decode_answer)

    async def scenario():
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        body, headers = dict(COMPLETION), {}
        if how == "header":
            headers["X-Request-Id"] = "client-7"
        else:
            body["request_id"] = "client-7" if how == "body" else "client-é"  # no header can carry that
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return await client.post("/v1/completions", json=body, headers=headers)
        finally:
            await router.stop()
            prefill.close()
            decode.close()

    assert asyncio.run(scenario()).status_code == 200
    ids = [c.request_id for c in prefill.posts() + decode.posts()]
    if how == "body-not-ascii":
        assert "client-é" not in ids and all(ids)  # the router's own (it was a 500)
    else:
        assert ids == ["client-7", "client-7"]


def test_min_tokens_reach_decode_and_the_prefill_gets_what_its_one_token_allows(serve):
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    prefill, decode = StandIn(prefill_answer()), StandIn(decode_answer)
    response, _ = serve(router, {"prefill-0": prefill, "decode-0": decode}, {**COMPLETION, "min_tokens": 3}, [])
    assert response.status_code == 200
    assert prefill.posts()[0].body["min_tokens"] == 1 and prefill.posts()[0].body["max_tokens"] == 1
    assert decode.posts()[0].body["min_tokens"] == 3


def test_a_prefill_that_hangs_up_is_replaced_by_another_prefill(serve):
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    gone, prefill, decode = StandIn(hang_up), StandIn(prefill_answer()), StandIn(decode_answer)
    response, _ = serve(router, {"prefill-gone": gone, "prefill-0": prefill, "decode-0": decode}, COMPLETION, [])
    assert response.status_code == 200 and response.headers["x-pdcluster-prefill"] == "prefill-0"
    assert (len(gone.posts()), len(prefill.posts()), len(decode.posts())) == (1, 1, 1)
    assert metric(router, 'pdcluster_retries_total{role="prefill"}') == 1


async def refuse(call, out):
    """An engine host whose engine died (engine/dead_engine.py): 503, nothing started."""
    await out.json({"error": {"message": "the engine of x died", "type": "engine_dead", "code": 503}}, 503)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_replica_that_answers_503_started_nothing_and_the_request_goes_to_another(serve, role):
    """A 503 (an engine host whose engine died) is retried as a replica never reached: a prefill's
    request on another prefill, a decode's on another decode with the same lease (no second
    prefill). Before, the 503 was the client's answer."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    dead, prefill, decode = StandIn(refuse), StandIn(prefill_answer()), StandIn(decode_answer)
    stand_ins = {f"{role}-gone": dead, "prefill-0": prefill, "decode-live": decode}  # the dead one tried first
    response, lines = serve(router, stand_ins, {**COMPLETION, "stream": True}, [])
    assert response.status_code == 200, lines
    assert "".join(c["text"] for e in data(lines) for c in e["choices"]) == " t0 t1 t2"
    assert (len(dead.posts()), len(prefill.posts()), len(decode.posts())) == (1, 1, 1)
    assert lease_of(decode.posts()[0].body) == 1
    assert metric(router, f'pdcluster_retries_total{{role="{role}"}}') == 1


def test_a_continuation_that_fails_after_the_first_token_ends_the_stream_with_an_error(serve):
    """The client already has the prefill's token: with migration off, a decode replica reached
    that then fails before answering ends the stream with an error event, and nothing is
    prefilled again."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, migration_limit=0))
    prefill, gone, live = StandIn(prefill_answer()), StandIn(hang_up), StandIn(decode_answer)
    stand_ins = {"prefill-0": prefill, "decode-gone": gone, "decode-live": live}
    response, lines = serve(router, stand_ins, {**COMPLETION, "stream": True}, [])
    assert response.status_code == 200
    events = data(lines)
    assert events[0]["choices"][0]["text"] == " first"
    assert "upstream replica decode-gone failed mid-stream" in events[-1]["error"]["message"]
    assert events[-1]["error"]["param"] is None  # vLLM's error shape
    assert [line for line in lines if line.startswith("data: [DONE]")] == ["data: [DONE]"]  # as vLLM ends one
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    assert (len(prefill.posts()), len(live.posts())) == (1, 0)
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="upstream_error"}') == 1


@pytest.mark.parametrize("first_token_from_prefill", [False, True])
def test_a_decode_found_dead_while_the_prefill_ran_is_not_posted_to(serve, first_token_from_prefill):
    """The decode replica chosen with the prefill is declared dead by the controller while the
    prefill runs: the request was posted to it all the same (against a host cut off, a 5 s
    connect timeout and one of the role's attempts). Another decode replica is chosen instead."""
    router = Router(
        RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=first_token_from_prefill)
    )
    answer = prefill_answer()
    stand_ins = {}

    async def prefill_then_decode_0_dies(call, out):
        rows = [row(rid, rid.split("-")[0], s.url) for rid, s in stand_ins.items() if rid != "decode-0"]
        router.update_replicas(rows + [row("decode-0", "decode", stand_ins["decode-0"].url, ReplicaState.DEAD)])
        await answer(call, out)

    decode_0, decode_1 = StandIn(decode_answer), StandIn(decode_answer)
    stand_ins.update({"prefill-0": StandIn(prefill_then_decode_0_dies), "decode-0": decode_0, "decode-1": decode_1})
    response, lines = serve(router, stand_ins, {**COMPLETION, "stream": True}, [])
    assert response.status_code == 200, lines
    assert (len(decode_0.posts()), len(decode_1.posts())) == (0, 1)
    assert metric(router, 'pdcluster_retries_total{role="decode"}') == 0


@pytest.mark.parametrize("limit", [0, 2])
def test_the_token_ids_the_router_asks_decode_for_never_reach_the_client(serve, limit):
    """The continuation asks the decode replica for token ids (vLLM adds `token_ids` to every
    choice, and the whole prompt's `prompt_token_ids` to the first); they were removed only where
    the stream's progress was tracked for migration, so with `migration_limit: 0` every chunk
    carried them to a client that never asked (the first one the whole prompt)."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, migration_limit=limit))
    prefill, decode = StandIn(prefill_answer()), StandIn(resuming_decode)
    response, lines = serve(router, {"prefill-0": prefill, "decode-0": decode}, {**COMPLETION, "stream": True}, [])
    assert response.status_code == 200, lines
    events = data(lines)
    assert [c["text"] for e in events for c in e["choices"]][:2] == [" first", " t101"]
    assert decode.posts()[0].body["return_token_ids"] is True
    leaked = {key for e in events for part in (e, *e["choices"]) for key in part if "token_ids" in key}
    assert leaked == set(), leaked


def test_a_continuation_whose_decode_fails_before_answering_moves_to_another(serve):
    """The same failure with migration on (the default): the stream goes on on another decode
    replica from the prompt plus the first token, without a second prefill or an error."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    prefill, gone, live = StandIn(prefill_answer()), StandIn(hang_up), StandIn(resuming_decode)
    stand_ins = {"prefill-0": prefill, "decode-gone": gone, "decode-live": live}
    response, lines = serve(router, stand_ins, {**COMPLETION, "stream": True}, [])
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    texts = [c["text"] for e in data(lines) for c in e["choices"]]
    assert texts == [" first", " t101", " t102", " t103"]
    [resumed] = live.posts()
    assert resumed.body["prompt"] == PROMPT_IDS + [42] and "kv_transfer_params" not in resumed.body
    assert len(prefill.posts()) == 1
    assert metric(router, 'pdcluster_stream_migrations_total{outcome="ok"}') == 1


# -- no replica left: one answer ----------------------------------------------------------------


def exhausted_error(serve, role: str, replicas: int, mode: str = "disaggregated") -> tuple[dict, Router]:
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, mode=mode, phase_attempts=3))
    stand_ins = {}
    rows = [row(f"{role}-{i}", role) for i in range(replicas)]  # all unreachable
    if role == "decode":
        stand_ins["prefill-0"] = StandIn(prefill_answer())
    elif role == "prefill":
        stand_ins["decode-0"] = StandIn(decode_answer)
    response, _ = serve(router, stand_ins, COMPLETION, rows)
    assert response.status_code == 503, response.text
    return response.json(), router


@pytest.mark.parametrize(
    ("role", "mode"), [("prefill", "disaggregated"), ("decode", "disaggregated"), ("aggregated", "aggregated")]
)
def test_exhaustion_gets_the_same_503_whatever_the_pool_size(serve, role, mode):
    shapes = []
    for replicas in (2, 5):
        body, router = exhausted_error(serve, role, replicas, mode)
        tried = [f"{role}-{i}" for i in range(min(replicas, 3))]
        assert body["error"]["message"] == f"no ready {role} replica could take the request (tried: {', '.join(tried)})"
        shapes.append({k: v for k, v in body["error"].items() if k != "message"})
        assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="no_replica"}') == 1
        assert metric(router, f'pdcluster_retries_total{{role="{role}"}}') == 2
    assert shapes[0] == shapes[1] == {"type": "service_unavailable", "param": None, "code": 503}


def test_no_ready_decode_fails_fast_without_a_prefill(serve):
    """Decode is chosen before the prefill: no KV is computed (and leased) that nobody would pull."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    prefill = StandIn(prefill_answer())
    draining = row("decode-0", "decode", state=ReplicaState.DRAINING)
    response, _ = serve(router, {"prefill-0": prefill}, COMPLETION, [draining])
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "no ready decode replica could take the request (tried: none)"
    assert prefill.calls == []


# -- the relayed stream ---------------------------------------------------------------------------


def test_a_continuation_reads_as_the_clients_chat_and_its_tokens_are_timed(serve):
    """Each event of the decode replica's stream is read once for what it is (token, usage,
    [DONE]) and rewritten as the client's own chat stream; every token is timed."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    prefill, decode = StandIn(prefill_answer()), StandIn(decode_answer)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    response, lines = serve(router, {"prefill-0": prefill, "decode-0": decode}, chat, [], path="/v1/chat/completions")
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""]
    events = data(lines)
    assert {(e["id"], e["object"]) for e in events} == {("cmpl-p", "chat.completion.chunk")}
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"content": " first"},
        {"content": " t0"},
        {"content": " t1"},
        {"content": " t2"},
    ]
    [sent] = decode.posts()
    assert sent.path == "/v1/completions" and sent.body["prompt"] == [11, 12, 13, 42] and sent.body["max_tokens"] == 3
    assert metric(router, "pdcluster_ttft_seconds_count") == 1
    assert metric(router, "pdcluster_itl_seconds_count") == 3  # four tokens, three gaps
    # the first of them is the handoff: the prefill's token, then decode's first
    assert metric(router, "pdcluster_handoff_gap_seconds_count") == 1


def test_a_kv_failure_in_the_decode_stream_reaches_the_client_as_what_it_is(serve):
    """A decode engine whose KV pull failed says so in its own error event (engine/kv_errors.py):
    the router relays it as is and counts it as a KV transfer error, without asking anyone."""
    failure = {
        "message": "KV handoff from c-prefill-0 to c-decode-0 failed and kv_transfer.failure_policy=fail: lease expired",
        "type": "kv_transfer_error",
        "code": 502,
    }

    async def failing_decode(call, out):
        await out.sse([f"data: {json.dumps({'error': failure})}", "data: [DONE]"])

    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    prefill, decode = StandIn(prefill_answer()), StandIn(failing_decode)
    _, lines = serve(router, {"prefill-0": prefill, "decode-0": decode}, {**COMPLETION, "stream": True}, [])
    [error] = data(lines)
    assert error["error"] == failure
    assert [c.method for c in decode.calls] == ["POST"]  # nothing asked afterwards
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="kv_transfer_error"}') == 1


def test_a_prefill_answer_without_a_usable_lease_is_an_upstream_error(serve):
    """A 200 from the prefill whose body is a JSON list (not an answer), or an answer whose
    lease does not validate: the client gets a clear 502, counted; nothing reaches decode."""

    async def not_an_answer(call, out):
        await out.json(["not", "an", "answer"])  # type: ignore[arg-type]

    async def bad_lease(call, out):
        await out.json({"choices": [], "kv_transfer_params": {"remote_engine_id": "p"}})

    for answer, why in ((not_an_answer, "unusable answer"), (bad_lease, "lacks 'remote_endpoints'")):
        router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
        decode = StandIn(decode_answer)
        response, _ = serve(router, {"prefill-0": StandIn(answer), "decode-0": decode}, COMPLETION, [])
        assert response.status_code == 502, response.text
        assert response.json()["error"]["type"] == "upstream_error" and why in response.json()["error"]["message"]
        assert decode.posts() == []
        assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="upstream_error"}') == 1


# -- mid-stream failover ---------------------------------------------------------------------------


def test_a_stream_past_the_requests_deadline_ends_with_a_timeout_event(serve):
    """router.request_timeout_seconds bounds the whole request, not only each read: a stream
    whose tokens keep coming, but too slowly for the deadline, is ended."""
    router = Router(
        RouterSettings(
            model_name="tiny", engine_token=ENGINE_TOKEN, request_timeout_s=1.5, first_token_from_prefill=False
        )
    )

    async def slow(call, out):
        events = token_events(list(range(100, 140)), prompt=PROMPT_IDS)
        out._writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            data = (event + "\n\n").encode()
            out._writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await out._writer.drain()
            await asyncio.sleep(0.2)  # pacing: a token every 0.2 s, each read well within 1.5 s

    body = {**COMPLETION, "max_tokens": 40, "stream": True}
    response, lines = serve(router, {"prefill-0": StandIn(prefill_answer()), "decode-0": StandIn(slow)}, body, [])
    events = data(lines)
    assert events[-1]["error"]["code"] == 504 and "request_timeout_seconds" in events[-1]["error"]["message"]
    assert 0 < len(events) - 1 < 40
    assert [line for line in lines if line.startswith("data: [DONE]")] == ["data: [DONE]"]


# -- no prefill replica ready -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_with_no_prefill_ready_decode_serves_the_whole_request(serve, stream):
    """Prefill scaled to 0 (or all dead): decode computes the prompt itself instead of every
    request getting 503; counted as the decode path, and /health stays ok."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))

    async def whole(call, out):
        if call.body.get("stream"):
            chunk = {"id": "cmpl-d", "object": "text_completion", "created": 2, "model": "tiny"}
            events = [json.dumps({**chunk, "choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in "ab"]
            await out.sse([f"data: {e}" for e in events] + ["data: [DONE]"])
        else:
            await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": "ab"}]})

    decode = StandIn(whole)
    draining = row("prefill-0", "prefill", state=ReplicaState.DRAINING)
    response, lines = serve(router, {"decode-0": decode}, {**COMPLETION, "stream": stream}, [draining])
    assert response.status_code == 200, response.text
    text = "".join(c["choices"][0]["text"] for c in data(lines)) if stream else response.json()["choices"][0]["text"]
    assert text == "ab"
    [sent] = decode.posts()
    assert "kv_transfer_params" not in sent.body  # nothing to pull: decode computed the prompt
    assert metric(router, 'pdcluster_route_decisions_total{path="decode"}') == 1
    assert metric(router, 'pdcluster_route_decisions_total{path="pd"}') == 0
    assert router.is_ready() and router.route_decisions() == {"decode": 1}


def test_a_request_whose_prefill_leaves_midway_is_counted_once_as_the_path_it_ended_on(serve):
    """Routed `pd`, its only prefill replica hangs up and leaves the pool (drained) meanwhile:
    decode computes the prompt, and /metrics counts the request once, as `decode`."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))

    async def whole(call, out):
        await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": "ab"}]})

    async def leaves(call, out):
        rows = [row("prefill-0", "prefill", state=ReplicaState.DRAINING), row("decode-0", "decode", decode.url)]
        router.update_replicas(rows)
        out.hang_up()

    prefill, decode = StandIn(leaves), StandIn(whole)
    response, _ = serve(router, {"prefill-0": prefill, "decode-0": decode}, COMPLETION, [])
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ab"
    assert len(prefill.posts()) == 1
    [sent] = decode.posts()
    assert "kv_transfer_params" not in sent.body  # decode computed the prompt
    assert router.route_decisions() == {"decode": 1}
