"""Mid-stream decode failover through the router (migration.py) against stand-in replicas on
real sockets (replica_stand_ins.py): a decode stream that breaks goes on on another replica from
exactly where it broke, or starts over when the client has nothing yet; what cannot migrate ends
with an error event. With live engines: tests/e2e/pd/test_reliability.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdcluster.orchestrator.router import Router, RouterSettings
from tests.unit.replica_stand_ins import (
    COMPLETION,
    ENGINE_TOKEN,
    PROMPT_IDS,
    StandIn,
    data,
    dying_decode,
    metric,
    prefill_answer,
    resuming_decode,
    row,
    running,
    token_events,
)


@pytest.mark.parametrize("first_token_from_prefill", [False, True])
def test_a_decode_that_dies_mid_stream_is_continued_on_another_without_an_error(serve, first_token_from_prefill):
    """The client's stream goes on where it broke: another decode replica continues from the
    prompt plus the tokens already sent (their ids), with that many fewer to generate; the
    client sees one stream, its own response id, no token ids it did not ask for."""
    router = Router(
        RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=first_token_from_prefill)
    )
    prefill, dying, survivor = StandIn(prefill_answer()), StandIn(dying_decode([100, 101])), StandIn(resuming_decode)
    body = {**COMPLETION, "max_tokens": 6, "stream": True, "temperature": 0}
    response, lines = serve(router, {"prefill-0": prefill, "decode-0": dying, "decode-1": survivor}, body, [])
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    events = data(lines)
    assert not [e for e in events if "error" in e]
    texts = [c["text"] for e in events for c in e["choices"]]
    first = [" first"] if first_token_from_prefill else []
    sent = [42, 100, 101] if first_token_from_prefill else [100, 101]
    resumed_tokens = range(100 + len(sent), 100 + 6)  # the stand-in numbers tokens by position
    assert texts == first + [" t100", " t101"] + [f" t{t}" for t in resumed_tokens]
    assert not any("token_ids" in c or "prompt_token_ids" in c for e in events for c in e["choices"])
    assert len({e["id"] for e in events}) == 1  # one response, as the client's own
    [resumed] = survivor.posts()
    assert resumed.body["prompt"] == PROMPT_IDS + sent and resumed.body["max_tokens"] == 6 - len(sent)
    assert "kv_transfer_params" not in resumed.body  # the survivor computes the prefix itself
    assert metric(router, 'pdcluster_stream_migrations_total{outcome="ok"}') == 1


@pytest.mark.parametrize("first_token_from_prefill", [False, True])
def test_a_stream_broken_mid_character_resumes_before_the_characters_first_bytes(serve, first_token_from_prefill):
    """The stream breaks after a token whose bytes begin a character (vLLM holds them back: its
    event has no text). A stream resumed after it would be detokenized from its start (the client
    got the whole prompt's text again); it resumes before it, and that token comes again."""
    router = Router(
        RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=first_token_from_prefill)
    )

    async def dies_mid_character(call, out):
        events = token_events([100, 101, 102], prompt=PROMPT_IDS)
        held = json.loads(events[2][6:])
        held["choices"][0]["text"] = ""  # 102: a character's first bytes
        await out.sse([*events[:2], f"data: {json.dumps(held)}"], then_hang_up=True)

    prefill, dying, survivor = StandIn(prefill_answer()), StandIn(dies_mid_character), StandIn(resuming_decode)
    body = {**COMPLETION, "max_tokens": 6, "stream": True, "temperature": 0}
    response, lines = serve(router, {"prefill-0": prefill, "decode-0": dying, "decode-1": survivor}, body, [])
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    kept = [42, 100, 101] if first_token_from_prefill else [100, 101]
    [resumed] = survivor.posts()
    assert resumed.body["prompt"] == PROMPT_IDS + kept and resumed.body["max_tokens"] == 6 - len(kept)
    texts = [c["text"] for e in data(lines) for c in e["choices"]]
    first = [" first"] if first_token_from_prefill else []
    assert texts == first + [" t100", " t101", ""] + [f" t{t}" for t in range(100 + len(kept), 106)]


def test_a_decode_alone_that_dies_before_its_first_event_starts_the_request_over_on_another(serve):
    """Decode computing a request alone (no prefill replica, or the local-prefill path) answers,
    then dies while computing the prompt: the client has nothing yet, so the same request starts
    over on another decode replica, and the client sees one clean stream."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))

    async def whole(call, out):
        await out.sse(token_events([100, 101, 102, 103], start=1, prompt=PROMPT_IDS, finish=True) + ["data: [DONE]"])

    gone, live = StandIn(dying_decode([])), StandIn(whole)
    body = {**COMPLETION, "stream": True, "temperature": 0}
    response, lines = serve(router, {"decode-gone": gone, "decode-live": live}, body, [])
    assert response.status_code == 200 and lines[-2:] == ["data: [DONE]", ""], lines
    events = data(lines)
    assert not [e for e in events if "error" in e]
    assert [c["text"] for e in events for c in e["choices"]] == [" t100", " t101", " t102", " t103"]
    assert not any("token_ids" in c or "prompt_token_ids" in c for e in events for c in e["choices"])
    [restarted] = live.posts()
    assert restarted.path == "/v1/completions" and restarted.body["prompt"] == COMPLETION["prompt"]
    assert "kv_transfer_params" not in restarted.body
    assert metric(router, 'pdcluster_stream_migrations_total{outcome="ok"}') == 1


@pytest.mark.parametrize(("change", "limit"), [({"stop": ["\n"]}, 2), ({}, 0)])
def test_a_stream_that_cannot_migrate_ends_with_an_error_event(serve, change, limit):
    """A request whose meaning would not survive the split (a stop string), or migration off."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, migration_limit=limit))
    prefill, dying, survivor = StandIn(prefill_answer()), StandIn(dying_decode([100, 101])), StandIn(resuming_decode)
    body = {**COMPLETION, "max_tokens": 6, "stream": True, "temperature": 0, **change}
    response, lines = serve(router, {"prefill-0": prefill, "decode-0": dying, "decode-1": survivor}, body, [])
    errors = [e for e in data(lines) if "error" in e]
    assert len(errors) == 1 and "failed mid-stream" in errors[0]["error"]["message"]
    assert survivor.posts() == []


def test_a_stream_on_a_replica_declared_dead_moves_at_once_instead_of_waiting_for_a_timeout():
    """A decode replica that stops answering mid-stream (alive, silent: no read error would
    come before the 600 s timeout) is declared dead by the controller: the router cuts its
    connections, never chooses it again, and the stream continues on another replica."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    prefill, survivor = StandIn(prefill_answer()), StandIn(resuming_decode)

    async def silent_after_two(call, out):
        await out.sse(token_events([100, 101], prompt=PROMPT_IDS), keep_open=True)
        await asyncio.Event().wait()  # alive, and silent from here on

    stuck = StandIn(silent_after_two)

    async def scenario():
        url = await running(router, prefill, stuck, survivor)
        rows = {
            "prefill-0": row("prefill-0", "prefill", prefill.url),
            "decode-1": row("decode-1", "decode", survivor.url),
        }
        router.update_replicas([rows["prefill-0"], row("decode-0", "decode", stuck.url)])
        body = {**COMPLETION, "max_tokens": 6, "stream": True, "temperature": 0}
        texts = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            texts += [c["text"] for c in json.loads(line[6:])["choices"]]
                        if len(texts) == 2 and "decode-1" not in router.replicas:
                            # what the controller's monitor does once decode-0 failed its checks
                            router.update_replicas(list(rows.values()))
        finally:
            await router.stop()
            for stand_in in (prefill, stuck, survivor):
                stand_in.close()
        return texts

    texts = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert texts == [f" t{t}" for t in range(100, 106)]
    assert metric(router, 'pdcluster_stream_migrations_total{outcome="ok"}') == 1


def test_a_client_that_leaves_while_its_stream_moves_is_counted_cancelled(run):
    """The client leaves while the router posts its broken stream to another decode replica: that
    replica's request is abandoned, and the request counts as cancelled (it counted as ok: the
    cancellation came while the stream moved, where nothing recorded it)."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, first_token_from_prefill=False))
    hung_up = asyncio.Event()

    async def working_forever(call, out):
        await out.until_the_router_hangs_up()
        hung_up.set()

    prefill, dying, survivor = StandIn(prefill_answer()), StandIn(dying_decode([5, 6])), StandIn(working_forever)

    async def scenario():
        url = await running(router, prefill, dying, survivor)
        rows = [row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", dying.url)]
        router.update_replicas([*rows, row("decode-1", "decode", survivor.url)])
        try:
            async with httpx.AsyncClient(base_url=url, timeout=20.0) as client:
                body = {**COMPLETION, "max_tokens": 6, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            break
                    while not survivor.posts():  # the stream broke and is on its way to decode-1
                        await asyncio.sleep(0.02)
            await asyncio.wait_for(hung_up.wait(), 20)  # the client left: decode-1's request ends
        finally:
            await router.stop()
            for stand_in in (prefill, dying, survivor):
                stand_in.close()

    run(scenario, 60)
    assert all(r.inflight_requests == 0 for r in router.replicas.values())
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="cancelled"}') == 1
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="ok"}') == 0
