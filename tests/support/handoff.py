"""What the KV handoff tests do to real engines over HTTP, as the router does
(tests/e2e/handoff/): complete, hand off, read an engine's info, wait for what the
engines report, and run the router in process in front of them."""

from __future__ import annotations

import time

import httpx

from pdcluster.keys import engine_http_token
from tests.support.identity import Greedy, identity_fields

NAME = "tiny"


def complete(engine, prompt, max_tokens, **extra):
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **identity_fields(),
        **extra,
    }
    with engine.client() as client:
        response = client.post("/v1/completions", json=body)
    return response


def info(engine) -> dict:
    with engine.client() as client:
        return client.get("/pdcluster/info").json()


def handoff(prefill, decode, prompt, max_tokens, **extra):
    """What the router does: returns (decode response, the params P handed over)."""
    # the prefill's own answer is never streamed (the router asks for one token, as JSON)
    once = {key: value for key, value in extra.items() if key != "stream"}
    first = complete(prefill, prompt, 1, kv_transfer_params={"do_remote_decode": True}, **once)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    return complete(decode, prompt, max_tokens, kv_transfer_params=params, **extra), params


def greedy(response: httpx.Response) -> Greedy:
    assert response.status_code == 200, response.text
    return Greedy.from_choice(response.json()["choices"][0])


def wait_for(predicate, timeout_s, what, seen=None):
    """Await a condition the engines report (bounded, re-checked on every answer); `seen()`: what
    the timeout's message shows of the state it ended in."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"; seen: {seen()}" if seen else ""))
        time.sleep(0.2)


def through_router(engines, replicas: list[tuple[str, str, str]], requests, **settings):
    """The router (in process, round robin) in front of `replicas` (replica id, role, url): the
    awaited `requests(client)`'s result, the router's metrics exposition and its in-flight counts."""
    import asyncio

    from pdcluster.orchestrator.replicas import ReplicaState
    from pdcluster.orchestrator.router import Router, RouterSettings

    rows = [
        {
            "replica_id": rid,
            "role": role,
            "url": url,
            "state": int(ReplicaState.READY),
            "node": "127.0.0.1",
            "stats": {},
        }
        for rid, role, url in replicas
    ]

    async def scenario():
        token = engine_http_token(engines["decode"].secret)
        router = Router(RouterSettings(model_name=NAME, policy="round_robin", engine_token=token, **settings))
        router.update_replicas(rows)
        url = await router.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                result = await requests(client)
        finally:
            await router.stop()
        return result, router.metrics.exposition().decode(), router.inflight()

    return asyncio.run(scenario())
