"""The router's request path against replicas that are really unreachable (closed ports on
127.0.0.1): every prefill replica is tried once, then the client gets a clear 503; the router
itself keeps serving. (The same paths with live engines are in tests/e2e/test_reliability.py.)"""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import httpx

from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router import Router, RouterSettings

TINY_MODEL = Path(__file__).resolve().parents[2] / "models" / "pdcluster-tiny-code"


def closed_port() -> int:
    """A port nothing listens on (bound, then released): connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row(replica_id: str, role: str) -> dict:
    return {"replica_id": replica_id, "role": role, "url": f"http://127.0.0.1:{closed_port()}",
            "state": int(ReplicaState.READY), "node": "127.0.0.1", "stats": {}}


async def _call(router: Router, path: str, body: dict | None = None) -> httpx.Response:
    url = await router.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            if body is None:
                return await client.get(path)
            return await client.post(path, json=body)
    finally:
        await router.stop()


def test_every_prefill_unreachable_gives_503_after_trying_each_once():
    router = Router(RouterSettings(model_name="tiny", phase_attempts=3))
    router.update_replicas([row("prefill-0", "prefill"), row("prefill-1", "prefill"), row("decode-0", "decode")])
    response = asyncio.run(_call(router, "/v1/completions", {"model": "tiny", "prompt": "def f():", "max_tokens": 4}))
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and "no ready prefill replica" in error["message"]
    metrics = router.metrics.exposition().decode()
    assert re.search(r'pdcluster_retries_total\{role="prefill"\} 2\.0', metrics), metrics  # both were tried
    assert re.search(r'pdcluster_requests_total\{endpoint="completions",outcome="no_replica"\} 1\.0', metrics)
    assert all(r.inflight_requests == 0 for r in router.replicas.values())  # nothing leaked


def test_aggregated_replicas_unreachable_gives_503():
    router = Router(RouterSettings(model_name="tiny", mode="aggregated", phase_attempts=2))
    router.update_replicas([row("aggregated-0", "aggregated")])
    response = asyncio.run(_call(router, "/v1/chat/completions",
                                 {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"


def test_prompt_tokens_counted_by_the_tokenizer_loaded_in_the_background():
    from transformers import AutoTokenizer

    from pdcluster.orchestrator.router import INLINE_TOKENIZE_CHARS

    model = str(TINY_MODEL)
    reference = AutoTokenizer.from_pretrained(model)
    short = "def add(a, b):\n    return a + b\n"
    long = "for i in range(10):\n    total += i * x\n" * (INLINE_TOKENIZE_CHARS // 30 + 10)
    assert len(long) > INLINE_TOKENIZE_CHARS >= len(short)

    async def scenario():
        router = Router(RouterSettings(model_name="tiny", tokenizer_path=model))
        await router.start("127.0.0.1", 0)  # returns without waiting for the tokenizer
        try:
            await router._tokenizer_loading
            counted = [await router._prompt_tokens({"prompt": text}, "completions") for text in (short, long)]
            by_ids = await router._prompt_tokens({"prompt": [1, 2, 3]}, "completions")
        finally:
            await router.stop()
        return counted, by_ids

    counted, by_ids = asyncio.run(scenario())
    assert counted == [len(reference(short)["input_ids"]), len(reference(long)["input_ids"])]
    assert by_ids == 3


def test_a_tokenizer_that_does_not_load_leaves_the_router_estimating(tmp_path, caplog):
    async def scenario():
        router = Router(RouterSettings(model_name="tiny", tokenizer_path=str(tmp_path / "missing")))
        await router.start("127.0.0.1", 0)
        try:
            await router._tokenizer_loading
            return await router._prompt_tokens({"prompt": "x" * 400}, "completions")
        finally:
            await router.stop()

    assert asyncio.run(scenario()) == 100
    assert "did not load" in caplog.text
