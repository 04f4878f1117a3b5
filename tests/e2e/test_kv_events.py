"""KV cache events from a real engine to the router's cache index (engine/kv_events.py,
orchestrator/router/cache_index.py): the router hashes prompts as the engine does, its index
predicts every request's prefix-cache hit exactly (vLLM's own `cached_tokens`) through inserts
and evictions, and a follower that lost its stream resyncs from a fresh snapshot."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import httpx
import pytest

from pdcluster.engine.kv_events import EVENTS_PATH
from pdcluster.orchestrator.router.cache_index import CacheIndex, Prompt
from pdcluster.orchestrator.router.requests import PromptTokens
from tests.support.cores import SECOND
from tests.support.engines import MODEL, run_engine, tiny_engine
from tests.support.prompts import heldout_prompts, token_prompt

pytestmark = pytest.mark.e2e

RID = "engine-0"
BLOCKS = 48  # the engine's whole KV cache: 48 blocks of 128 tokens, so the prompts below evict
SETTLE_S = 30.0  # bound on waiting for events the engine has already queued


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # bound to a core: the model runs in the engine core (one process fewer to start than vLLM's own layout)
    spec = tiny_engine(
        "events", kv_events=True, engine_args={"num_gpu_blocks_override": BLOCKS}, cpu_threads_bind=SECOND
    )
    with run_engine(spec, tmp_path_factory.mktemp("events")) as running:
        yield running


@pytest.fixture(scope="module")
def tokens():
    found = PromptTokens(str(MODEL))
    found._load()  # what the router does in a thread at its start
    assert found.tokenizer is not None
    return found


class Follower:
    """A CacheIndex following the engine, as the router runs it, plus the engine's answers."""

    def __init__(self, engine, tokens: PromptTokens):
        self.engine, self.tokens = engine, tokens
        self.http = httpx.AsyncClient(base_url=engine.url, headers=engine.headers, timeout=120)
        self.index = CacheIndex()
        self.index.http = self.http
        self.markers = random.Random()  # marker blocks no other request (of any module) holds

    def start(self) -> None:
        self.index.follow([{"replica_id": RID, "url": self.engine.url}])

    @property
    def cache(self):
        return self.index.replicas[RID]

    async def until(self, condition, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + SETTLE_S
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)  # the follower runs on this loop; give it turns

    async def prompt(self, body: dict, kind: str = "completions") -> Prompt:
        prompt = await self.tokens.prompt(body, kind)
        await self.until(lambda: self.index._hasher is not None, "the hasher to load")
        await self.index.prepare(prompt)
        return prompt

    async def settle(self) -> None:
        """Every event of the requests answered so far is in the index: a marker request's own
        block (random ids: a block nobody holds yet, so the engine stores it anew) arrives after
        them (one publisher queue, in order)."""
        marker = await self.prompt({"prompt": [self.markers.randrange(300, 4000) for _ in range(128)]})
        await self.complete(marker.ids)
        await self.until(lambda: self.cache.cached.holds(marker.hashes[0]), "the marker block's event")

    async def complete(self, prompt, path: str = "/v1/completions", **body) -> dict:
        key = "messages" if path.endswith("chat/completions") else "prompt"
        response = await self.http.post(path, json={"model": "tiny", key: prompt, "max_tokens": 1, **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    async def check(self, prompt: Prompt, path: str = "/v1/completions", send=None) -> int:
        """The index's prediction for `prompt` equals the engine's reported prefix-cache hit."""
        predicted = self.index.cached_tokens(RID, prompt)
        usage = await self.complete(send if send is not None else prompt.ids, path)
        assert usage["prompt_tokens"] == prompt.count
        assert usage["prompt_tokens_details"]["cached_tokens"] == predicted, (predicted, usage)
        await self.settle()
        return predicted

    async def close(self) -> None:
        await self.index.close()
        await self.http.aclose()


def run(engine, tokens, scenario) -> None:
    async def main():
        follower = Follower(engine, tokens)
        try:
            follower.start()
            await follower.until(lambda: follower.cache.synced, "the first snapshot")
            await scenario(follower)
        finally:
            await follower.close()

    asyncio.run(main())


def test_router_hashes_equal_the_engines_and_predict_every_hit(engine, tokens):
    """Completions (text and ids) and chats with a shared system prompt: the blocks the engine
    stored are the router's hashes; then, through evictions (the prompts need about three times
    the cache), each request's hit is what the index predicted, with some hits and some misses."""

    async def scenario(f: Follower):
        text = "\n".join(heldout_prompts()[:8])
        completion = await f.prompt({"prompt": text})
        assert completion.count > 256
        await f.check(completion, send=text)
        assert all(map(f.cache.cached.holds, completion.hashes))
        assert f.cache.verified is None or f.cache.verified
        system = {"role": "system", "content": "\n".join(heldout_prompts()[8:16])}
        hits = []
        for question in ("def parse(", "class Node:"):
            messages = [system, {"role": "user", "content": question}]
            chat = await f.prompt({"messages": messages}, "chat")
            assert chat.ids is not None and chat.count > 256
            hits.append(await f.check(chat, "/v1/chat/completions", send=messages))
            assert all(map(f.cache.cached.holds, chat.hashes))
        assert hits[0] == 0 and hits[1] >= 256  # the shared system prompt hits
        assert f.cache.verified is True  # the relay's probe block hashes as ours do
        shared = token_prompt(300, offset=2000)
        seen = []
        for i in range(14):  # ~6 blocks each, 48 in the cache: the early ones get evicted
            ids = shared + token_prompt(400, offset=5000 + 977 * (i % 9))
            seen.append(await f.check(await f.prompt({"prompt": ids})))
        assert any(seen) and not all(seen), seen
        assert f.cache.cached.blocks() <= BLOCKS

    run(engine, tokens, scenario)


def test_a_follower_that_lost_its_stream_resyncs(engine, tokens):
    """The stream is cut (as when the router's connection to the replica breaks); requests go on
    meanwhile, matched from history; the follower comes back with a fresh snapshot and its
    predictions are exact again."""

    async def scenario(f: Follower):
        ids = token_prompt(600, offset=30_000)
        first = await f.prompt({"prompt": ids})
        await f.check(first)
        epoch = f.cache.epoch
        f.index.sent(RID, first)
        # cut the follower's connection: the engine's relay sees a closed stream
        url, task = f.index._followers[RID]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        f.cache.synced = False
        assert f.cache.source() == "history"
        assert f.index.cached_tokens(RID, first) == 4 * 128  # history: its 4 full blocks were sent
        missed = await f.prompt({"prompt": token_prompt(500, offset=40_000)})
        await f.complete(missed.ids)  # its blocks' events go by while nobody follows
        del f.index._followers[RID]
        f.start()
        await f.until(lambda: f.cache.synced, "the resync")
        assert f.cache.epoch == epoch and f.cache.source() == "events"
        assert all(map(f.cache.cached.holds, missed.hashes))
        await f.check(missed)

    run(engine, tokens, scenario)


def test_the_events_stream_requires_the_engine_key(engine):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(engine.url + EVENTS_PATH, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_an_engine_followed_by_a_subscriber_stops_at_once(engine):
    """The router follows every replica's events (cache_aware, the default policy). An engine told
    to stop waited out its HTTP server's 10 s for that stream, which never ends by itself, then
    cancelled the server mid-shutdown (vLLM's own shutdown never ran, the stream was cut). The
    stream now ends when the engine stops, and the engine exits cleanly.
    It stops the module's engine (one engine start less for the suite): it is the module's last test."""
    with engine.client(timeout=60) as client, client.stream("GET", EVENTS_PATH) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["type"] == "snapshot"
        engine.process.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in lines if line]  # read until the engine ends it
    assert all(line["type"] == "heartbeat" for line in rest)
    assert engine.process.wait(timeout=60) == 0
    assert "did not stop in time" not in engine.log_path.read_text(errors="replace")
