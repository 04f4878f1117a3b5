"""The router, in process, in front of these engines: the first token from the prefill, decode
sent ahead, an unreachable decode replaced, and under `fail` clear errors while abandoned
leases expire."""

from __future__ import annotations

import json
import socket

import pytest

from tests.e2e.handoff.common import LEASE_S
from tests.support.engines import MAX_MODEL_LEN
from tests.support.handoff import NAME, complete, info, through_router, wait_for
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e


def test_router_streams_the_prefill_token_and_retries_an_unreachable_decode(engines):
    """The router (in process) in front of these engines: every stream gets its first token from
    the prefill and decode continues after it, token for token what the aggregated engine says;
    a decode replica that cannot be reached is replaced by the live one without prefilling again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # refused once released
    prompts = [token_prompt(40 + 53 * i, offset=3000 + 97 * i) for i in range(4)]
    expected = [complete(engines["agg"], p, 10).json()["choices"][0]["text"] for p in prompts]
    replicas = [
        ("prefill-0", "prefill", engines["prefill"].url),
        ("decode-dead", "decode", dead),
        ("decode-0", "decode", engines["decode"].url),
    ]

    async def requests(client):
        texts = []
        for prompt in prompts:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                assert response.headers["x-pdcluster-prefill"] == "prefill-0"
                events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: {")]
            texts.append("".join(c["text"] for e in events for c in json.loads(e)["choices"]))
        return texts

    texts, metrics, inflight = through_router(engines, replicas, requests)
    assert texts == expected
    assert 'pdcluster_first_token_source_total{role="prefill"} 4.0' in metrics
    assert (
        'pdcluster_retries_total{role="decode"}' in metrics and 'pdcluster_retries_total{role="prefill"}' not in metrics
    )
    assert all(count == 0 for count in inflight.values())


UNLIMITED_CHAT = {
    "model": NAME,
    "messages": [{"role": "user", "content": "def f(x):"}],
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def unlimited_chat_reference(engines):
    """The aggregated engine's answer to UNLIMITED_CHAT (a whole context of tokens: asked once)."""
    with engines["agg"].client() as client:
        return client.post("/v1/chat/completions", json=UNLIMITED_CHAT).json()


@pytest.mark.parametrize("decode_ahead", [False, True], ids=["after-prefill", "ahead"])
def test_a_chat_without_an_output_limit_streams_to_the_context_length(engines, unlimited_chat_reference, decode_ahead):
    """A streamed chat with no max_tokens runs to the context length, as the aggregated engine
    answers it (the continuation, a completions request, stopped at 16 tokens after the first:
    vLLM's default for a completions request without max_tokens)."""
    body, reference = UNLIMITED_CHAT, unlimited_chat_reference
    usage = reference["usage"]
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"] > 17
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]
    count = 2 if decode_ahead else 1  # under decode_ahead the first request's lease is the voucher

    async def requests(client):
        texts = []
        for _ in range(count):
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
            texts.append("".join(c["delta"].get("content") or "" for e in events for c in e["choices"]))
        return texts

    texts, metrics, _ = through_router(
        engines, replicas, requests, max_model_len=MAX_MODEL_LEN, decode_ahead=decode_ahead
    )
    assert texts == [reference["choices"][0]["message"]["content"]] * count
    assert f'pdcluster_first_token_source_total{{role="prefill"}} {count}.0' in metrics


def test_cached_tokens_in_usage_are_the_prefills_own_hit(engines):
    """usage.prompt_tokens_details.cached_tokens through P/D is the prefill's prefix-cache hit, as
    one engine reports it (vLLM hands decode the prefill's count in the lease's params; decode's
    own count is every prompt token, pulled)."""
    prompt = token_prompt(3 * 128 + 20, offset=6173)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    reference = complete(engines["agg"], prompt, 4).json()["usage"]["prompt_tokens_details"]
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]

    async def requests(client):
        return [(await client.post("/v1/completions", json=body)).json()["usage"] for _ in range(2)]

    (fresh, again), _, _ = through_router(engines, replicas, requests)
    assert fresh["prompt_tokens_details"]["cached_tokens"] == reference["cached_tokens"] == 0
    hit = again["prompt_tokens_details"]["cached_tokens"]
    assert hit in (2 * 128, 3 * 128)  # the prefill's hit: whole blocks (less the last under MTP)


def test_decode_sent_ahead_streams_what_the_aggregated_engine_says(engines):
    """router.decode_ahead: the continuation leaves with the prefill request and the decode engine
    finds the lease and the first token by key. Every stream after the first (whose lease becomes
    the voucher of the prefill's endpoints) goes that way, and each is token for token, usage
    included, what the aggregated engine answers."""
    prompts = [token_prompt(60 + 71 * i, offset=5000 + 89 * i) for i in range(5)]
    expected = [complete(engines["agg"], p, 10).json() for p in prompts]
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]

    async def requests(client):
        answers = []
        for prompt in prompts:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            body.update(stream=True, stream_options={"include_usage": True})
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            answers.append((text, [e["usage"] for e in events if e.get("usage")]))
        return answers

    answers, metrics, inflight = through_router(engines, replicas, requests, decode_ahead=True)
    for (text, usage), reference in zip(answers, expected):
        assert text == reference["choices"][0]["text"]
        assert [{k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} for u in usage] == [
            {k: reference["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        ]
    assert f'pdcluster_decode_ahead_total{{outcome="streamed"}} {len(prompts) - 1}.0' in metrics
    assert 'outcome="dropped"' not in metrics
    assert all(count == 0 for count in inflight.values())


def pull_failures(engine) -> dict[str, int]:
    """Failed loads by cause, but for `abandoned` (a request that ended before its lease came: the
    dropped continuation's, when the router drops it before decode found the lease)."""
    causes = info(engine)["stats"]["kv_pull_failures"]
    return {cause: n for cause, n in causes.items() if cause != "abandoned"}


def streamed(events) -> list[tuple]:
    """What a stream's events say, without their ids: each choice's text, finish and stop reason,
    and the usage."""
    said = []
    for event in events:
        for c in event["choices"]:
            said.append(
                (c.get("text", (c.get("delta") or {}).get("content")), c["finish_reason"], c.get("stop_reason"))
            )
        if event.get("usage"):
            said.append({k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
    return said


@pytest.mark.parametrize("decode_ahead", [False, True], ids=["after-prefill", "ahead"])
def test_a_stream_that_stops_at_its_first_token_is_the_prefills_answer(engines, decode_ahead):
    """A stream whose first token is a stop token: the prefill's answer is the whole answer, as the
    aggregated engine streams it, and decode is not asked (before: decode sampled token 1 again,
    so a sampled request stopped there with the square of its probability; with decode_ahead the
    request was also prefilled twice). Decode pulls nothing, the prefill is asked once, and the
    producer keeps no lease (its blocks come back well before a lease would expire)."""
    voucher, prompt = token_prompt(70, offset=9000), token_prompt(110, offset=9400)
    first = complete(engines["agg"], prompt, 1, return_token_ids=True).json()["choices"][0]["token_ids"][0]
    body = {"model": NAME, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop_token_ids": [first]}
    body.update(stream=True, stream_options={"include_usage": True})
    with engines["agg"].client() as client:
        with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
            expected = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]
    prefill, decode = engines["prefill"], engines["decode"]
    pulls_before = info(decode)["stats"]["kv_pulls_ok"]
    failed_before = pull_failures(decode)

    async def requests(client):
        answers = []
        for prompt_ids in (voucher, prompt):  # under decode_ahead the first request's lease is the voucher
            extra = {} if prompt_ids is voucher else {"stop_token_ids": [first]}
            async with client.stream("POST", "/v1/completions", json={**body, **extra, "prompt": prompt_ids}) as r:
                assert r.status_code == 200
                answers.append([json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")])
        return answers

    (_, events), metrics, inflight = through_router(engines, replicas, requests, decode_ahead=decode_ahead)
    assert streamed(events) == streamed(expected)
    assert streamed(events)[0][1:] == ("stop", first)
    wait_for(lambda: info(prefill)["stats"]["kv_cache_usage"] == 0.0, LEASE_S / 2, "the prefill's blocks back")
    wait_for(lambda: info(decode)["stats"]["kv_pulls_ok"] > pulls_before, 30, "the voucher request's pull counted")
    assert info(decode)["stats"]["kv_pulls_ok"] - pulls_before == 1  # the voucher request's pull only
    assert pull_failures(decode) == failed_before
    assert "pdcluster_prefill_seconds_count 2.0" in metrics
    assert 'pdcluster_first_token_source_total{role="prefill"} 2.0' in metrics
    if decode_ahead:
        assert 'pdcluster_decode_ahead_total{outcome="dropped"} 1.0' in metrics
    assert all(count == 0 for count in inflight.values())


def test_a_batch_of_prompts_gets_each_prompts_own_answer(engines):
    """A completion of several prompts: vLLM answers such a batch with its first prompt's lease
    only, which once reached every prompt's pull on decode (the second prompt continued from the
    first one's KV). Each choice is what the aggregated engine answers for its prompt alone."""
    prompts = [token_prompt(90, offset=7000), token_prompt(150, offset=7400)]
    expected = [complete(engines["agg"], p, 10).json()["choices"][0]["text"] for p in prompts]
    replicas = [("prefill-0", "prefill", engines["prefill"].url), ("decode-0", "decode", engines["decode"].url)]

    async def requests(client):
        body = {"model": NAME, "prompt": prompts, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]

    texts, metrics, inflight = through_router(engines, replicas, requests)
    assert texts == expected
    assert 'pdcluster_route_decisions_total{path="decode"} 1.0' in metrics  # no prefill, no lease
    assert all(count == 0 for count in inflight.values())


def test_fail_policy_through_the_router_gives_clear_errors_and_abandoned_leases_expire(engines):
    """The router in front of the prefill and a decode whose every pull fails (a layout mismatch,
    failure policy `fail`), half of the requests abandoned between prefill and decode (injected:
    a client gone): a failed pull is a 502 naming the KV handoff and the policy (an SSE error
    event when streaming), an abandoned one a 503, and the prefill's blocks all come back, the
    abandoned ones' once their leases expire."""
    prefill = engines["prefill"]
    baseline = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, 30, "idle P")
    replicas = [("prefill-0", "prefill", prefill.url), ("decode-0", "decode", engines["decode-mismatch"].url)]
    prompts = [token_prompt(150 + 40 * i, offset=311 * i) for i in range(10)]

    async def requests(client):
        answers = [
            await client.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 8}) for p in prompts
        ]
        body = {"model": NAME, "prompt": token_prompt(170, offset=9999), "max_tokens": 8, "stream": True}
        streamed = await client.post("/v1/completions", json=body)
        return answers, streamed

    (answers, streamed), _, _ = through_router(engines, replicas, requests, abandon_after_prefill_rate=0.5)
    abandoned = [r for r in answers if r.status_code == 503]
    failed = [r for r in answers if r.status_code != 503]
    assert abandoned and failed
    for r in abandoned:
        assert r.json()["error"]["type"] == "fault_injection"
    for r in failed:
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["type"] == "kv_transfer_error" and "failure_policy=fail" in error["message"], error
    assert "kv_transfer_error" in streamed.text or "fault_injection" in streamed.text
    # Failed pulls released their leases; abandoned ones were never pulled and expire.
    after = wait_for(lambda: (s := info(prefill)["stats"])["kv_cache_usage"] == 0.0 and s, LEASE_S + 30, "expiry")
    assert after["kv_leases_expired"] - baseline["kv_leases_expired"] >= len(abandoned)
