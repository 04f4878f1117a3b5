"""Cache-aware routing (policies.CacheAware) and conditional disaggregation (handoff._route):
the choice by what each replica holds, weighed against load, and the local-prefill path, against
stand-in replicas on real sockets. With live engines: tests/e2e/test_kv_events.py, pd/test_routing.py."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster import compat
from pdcluster.orchestrator.policies import CacheAware, ReplicaLoad
from pdcluster.orchestrator.router import Router, RouterSettings
from pdcluster.orchestrator.router.cache_index import (
    HISTORY_ONLY,
    CacheIndex,
    Prompt,
    ReplicaCache,
    history_hashes,
)
from tests.unit.replica_stand_ins import ENGINE_TOKEN, StandIn, decode_answer, post, prefill_answer, row, running


class Held:
    """What each replica's cache holds of the one prompt of a test, in tokens."""

    def __init__(self, **tokens: int):
        self.tokens = tokens

    def __call__(self, replica_id: str, prompt) -> int:
        return self.tokens.get(replica_id.replace("-", "_"), 0)


PROMPT = Prompt(list(range(1000)), 1000, hashes=[1, 2, 3, 4, 5, 6, 7], block_size=128)


def pool(role: str, n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"{role}-{i}", role, f"u{i}") for i in range(n)]


def test_prefill_goes_where_computing_plus_queued_tokens_is_least():
    replicas = pool("prefill", 2)
    policy = CacheAware(Held(prefill_1=896))
    assert policy.choose(replicas, "prefill", prompt=PROMPT).replica_id == "prefill-1"
    replicas[1].inflight_prompt_tokens = 800  # 104 + 800 to compute there, 1000 + 0 on prefill-0
    assert policy.choose(replicas, "prefill", prompt=PROMPT).replica_id == "prefill-1"
    replicas[1].inflight_prompt_tokens = 1000
    assert policy.choose(replicas, "prefill", prompt=PROMPT).replica_id == "prefill-0"


def test_decode_prefers_the_most_leading_blocks_within_the_load_slack():
    replicas = pool("decode", 3)
    policy = CacheAware(Held(decode_2=512, decode_1=128))
    assert policy.choose(replicas, "decode", prompt=PROMPT).replica_id == "decode-2"
    replicas[2].inflight_requests = 2  # within 2 sequences of the least loaded: still the cache
    assert policy.choose(replicas, "decode", prompt=PROMPT).replica_id == "decode-2"
    replicas[2].inflight_requests = 3  # too busy: the next best cache among the rest
    assert policy.choose(replicas, "decode", prompt=PROMPT).replica_id == "decode-1"


def test_without_a_hashed_prompt_cache_aware_is_least_loaded():
    replicas = pool("prefill", 2)
    replicas[0].inflight_prompt_tokens = 10
    policy = CacheAware(Held(prefill_0=896))
    assert policy.choose(replicas, "prefill").replica_id == "prefill-1"
    assert policy.choose(replicas, "prefill", prompt=Prompt(None, 1000)).replica_id == "prefill-1"


def test_short_prompts_skip_the_prefill_under_local_prefill_max_tokens():
    """Conditional disaggregation by length: a prompt decode may compute itself goes there
    alone (no prefill call, nothing to pull), counted as local_prefill; a longer one takes P/D."""
    settings = RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, local_prefill_max_tokens=8)
    router = Router(settings)
    prefill, decode = StandIn(prefill_answer()), StandIn(decode_answer)

    async def local_answer(call, out):
        if "kv_transfer_params" in call.body:
            await decode_answer(call, out)
        else:
            await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": "local"}]})

    decode.answer = local_answer

    async def scenario():
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        try:
            short, _ = await post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
            long, _ = await post(url, "/v1/completions", {"model": "tiny", "prompt": list(range(20)), "max_tokens": 2})
            return short, long
        finally:
            await router.stop()
            prefill.close()
            decode.close()

    short, long = asyncio.run(scenario())
    assert short.json()["choices"][0]["text"] == "local" and "x-pdcluster-prefill" not in short.headers
    assert long.json()["choices"][0]["text"] == "decoded lease 1" and long.headers["x-pdcluster-prefill"] == "prefill-0"
    assert len(prefill.posts()) == 1
    assert router.route_decisions() == {"local_prefill": 1, "pd": 1}


def test_prompts_go_to_decode_while_prefill_has_local_prefill_queue_tokens_in_flight():
    """Conditional disaggregation by load: while the one prefill replica still computes a
    20-token prompt, the next 20-token prompt would queue behind 20 tokens (the threshold: 20),
    so decode computes it itself (counted as local_queue); a 21-token prompt is longer than the
    threshold and waits for the prefill (decode's streams do not stall for it); once prefill is
    free, prompts take P/D again."""
    settings = RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, local_prefill_queue_tokens=20)
    router = Router(settings)
    arrivals: asyncio.Queue = asyncio.Queue()
    finish = asyncio.Event()
    prefilled = prefill_answer()

    async def busy_prefill(call, out):
        arrivals.put_nowait(len(call.body["prompt"]))
        await finish.wait()
        await prefilled(call, out)

    async def local_answer(call, out):
        if "kv_transfer_params" in call.body:
            await decode_answer(call, out)
        else:
            await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": "local"}]})

    prefill, decode = StandIn(busy_prefill), StandIn(local_answer)
    body = {"model": "tiny", "prompt": list(range(20)), "max_tokens": 2}
    other = dict(body, prompt=list(range(100, 120)))  # prompts sharing no prefix: all to compute
    longer = dict(body, prompt=list(range(200, 221)))

    async def scenario():
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        try:
            first = asyncio.create_task(post(url, "/v1/completions", body))
            assert await asyncio.wait_for(arrivals.get(), 30) == 20  # prefill is computing the first prompt
            queued, _ = await post(url, "/v1/completions", other)
            waiting = asyncio.create_task(post(url, "/v1/completions", longer))
            assert await asyncio.wait_for(arrivals.get(), 30) == 21  # the longer prompt waits at the busy prefill
            finish.set()
            (first, _), (waited, _) = await first, await waiting
            after, _ = await post(url, "/v1/completions", body)
            return first, queued, waited, after
        finally:
            await router.stop()
            prefill.close()
            decode.close()

    first, queued, waited, after = asyncio.run(scenario())
    assert queued.json()["choices"][0]["text"] == "local" and "x-pdcluster-prefill" not in queued.headers
    texts = {first.json()["choices"][0]["text"], waited.json()["choices"][0]["text"]}
    assert texts == {"decoded lease 1", "decoded lease 2"} and waited.headers["x-pdcluster-prefill"] == "prefill-0"
    assert (
        after.json()["choices"][0]["text"] == "decoded lease 3" and after.headers["x-pdcluster-prefill"] == "prefill-0"
    )
    assert router.route_decisions() == {"local_queue": 1, "pd": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_without_events_a_repeated_prompt_follows_the_routers_history(stream):
    """Replicas that publish no KV events (stand-ins answer 404 there): the router matches from the
    prompts it sent each one,
    so a repeated prompt goes back to the prefill replica that computed it, a new one elsewhere."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, policy="cache_aware"))

    async def scenario():
        prefills = [StandIn(prefill_answer()) for _ in range(2)]
        decode = StandIn(decode_answer)
        url = await running(router, *prefills, decode)
        rows = [row(f"prefill-{i}", "prefill", s.url) for i, s in enumerate(prefills)]
        router.update_replicas(rows + [row("decode-0", "decode", decode.url)])
        cache = router.pool.cache
        try:
            while cache._hasher is None:  # the history hasher loads once the replicas said 404
                await asyncio.sleep(0.01)
            chosen = []
            for prompt in (list(range(100)), list(range(500, 600)), list(range(100)), list(range(500, 600))):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}
                response, _ = await post(url, "/v1/completions", body)
                assert response.status_code == 200
                chosen.append(response.headers["x-pdcluster-prefill"])
            return chosen, cache.summary()
        finally:
            await router.stop()
            for s in (*prefills, decode):
                s.close()

    chosen, summary = asyncio.run(scenario())
    assert chosen[0] != chosen[1] and chosen[2:] == chosen[:2]
    assert {r["source"] for r in summary.values()} == {"history"}
    # 6 blocks of 16 tokens per prompt: one prompt on each prefill replica, both on decode
    assert [summary[r]["history"] for r in ("prefill-0", "prefill-1", "decode-0")] == [6, 6, 12]


def test_history_alone_imports_no_vllm_hasher_and_an_engine_snapshot_brings_vllms():
    """Replicas without events (HISTORY_ONLY) are matched by the router's own chained hashes: no
    vLLM import on the router's loop (it stalled every request for seconds). The first engine
    snapshot swaps in vLLM's hasher, even under the same algorithm name."""

    async def scenario():
        index = CacheIndex()
        index._learn(HISTORY_ONLY, provisional=True)
        assert index._hasher is history_hashes and index.hashing == "history"
        index._learn({"block_size": 128, "hash_algo": "sha256"})  # an engine's snapshot
        assert index._hasher is not history_hashes and index._hasher_loading is not None
        await index._hasher_loading  # in a thread; done at once where vLLM is imported already
        return index

    index = asyncio.run(scenario())
    assert index.block_size == 128 and index.hashing == "sha256" and index._hasher not in (None, history_hashes)
    engine = list(range(300, 300 + 3 * 128))
    assert index._hasher(engine, 128) == compat.block_hasher("sha256")(engine, 128)
    prompt = list(range(100, 180))
    assert history_hashes(prompt, 16) == history_hashes(prompt + [7, 8, 9], 16)[:5]
    assert len(set(history_hashes(prompt, 16))) == 5 and history_hashes(prompt[:15], 16) == []


def test_a_salted_prompt_hashes_as_the_engine_does_and_matches_only_its_own_salt():
    """vLLM folds a request's cache_salt into its first block's hash: the router hashes it the
    same (checked against vLLM's own request block hasher), so a salted request is predicted no
    hit on blocks of the same prompt unsalted or under another salt (before: the router left the
    salt out and predicted the unsalted copy's hit, which the engine never gives)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from pdcluster.compat.vllm_prefix import external_hash

    ids = list(range(300, 300 + 3 * 128))
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(128, hash_fn)
    engine = Request("r", ids, SamplingParams(max_tokens=1), None, cache_salt="tenant-a", block_hasher=hasher)
    router_hashes = compat.block_hasher("sha256")(ids, 128, "tenant-a")
    assert router_hashes == [external_hash(h) for h in engine.block_hashes]
    assert router_hashes[1:] != compat.block_hasher("sha256")(ids, 128)[1:]  # the salt changes the whole chain

    async def scenario():
        index = CacheIndex()
        index._learn(HISTORY_ONLY, provisional=True)  # the router's history (no events here)
        index.replicas["prefill-0"] = ReplicaCache("prefill-0", events=False)
        held = {}
        for salt in (None, "tenant-a", "tenant-b"):
            prompt = Prompt(ids + [1], len(ids) + 1, cache_salt=salt)
            await index.prepare(prompt)
            held[salt] = index.cached_tokens("prefill-0", prompt)
            index.sent("prefill-0", prompt)
            await index.prepare(again := Prompt(ids + [2], len(ids) + 1, cache_salt=salt))
            assert index.cached_tokens("prefill-0", again) == len(ids)  # its own salt: a hit
        return held

    assert asyncio.run(scenario()) == {None: 0, "tenant-a": 0, "tenant-b": 0}


@pytest.mark.parametrize("line", [b"[1, 2]", b'{"type": "batch", "seq": 1, "ops": [7]}'])
def test_a_follower_given_a_malformed_event_resubscribes_instead_of_dying(line):
    """A KV events line that is JSON but not an event object (a list; an op that is no list)
    raised AttributeError / TypeError, which the follower did not catch: its task ended, the
    replica's index stayed marked as it was, and nothing followed that replica again. It logs,
    resubscribes and goes on."""
    import httpx

    from pdcluster.orchestrator.router.cache_index import CacheIndex

    subscriptions = []

    async def events(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        subscriptions.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        body = line + b"\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        await writer.drain()
        writer.close()

    async def scenario() -> tuple[int, bool]:
        server = await asyncio.start_server(events, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        index = CacheIndex()
        async with httpx.AsyncClient() as http:
            index.http = http
            index.follow([{"replica_id": "decode-0", "url": url}])
            task = index._followers["decode-0"][1]
            for _ in range(200):
                if len(subscriptions) >= 2 or task.done():
                    break
                await asyncio.sleep(0.05)  # the follower's reconnect pause (RETRY_S)
            alive = not task.done()
            await index.close()
        server.close()
        return len(subscriptions), alive

    count, alive = asyncio.run(scenario())
    assert alive and count >= 2
