"""The router's request path against replicas that are really unreachable (closed ports on
127.0.0.1): every prefill replica is tried once, then the client gets a clear 503; the router
itself keeps serving (the same paths with live engines: tests/e2e/pd/test_reliability.py). And a
client that goes away: the engine's request is abandoned (stand-in replicas, replica_stand_ins.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from pdcluster.orchestrator.router import Router, RouterSettings
from tests.unit.replica_stand_ins import (
    COMPLETION,
    ENGINE_TOKEN,
    StandIn,
    decode_answer,
    metric,
    prefill_answer,
    row,
    running,
)

TINY_MODEL = Path(__file__).resolve().parents[2] / "models" / "pdcluster-tiny-code"


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
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, phase_attempts=3))
    router.update_replicas([row("prefill-0", "prefill"), row("prefill-1", "prefill"), row("decode-0", "decode")])
    response = asyncio.run(_call(router, "/v1/completions", {"model": "tiny", "prompt": "def f():", "max_tokens": 4}))
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and "no ready prefill replica" in error["message"]
    metrics = router.metrics.exposition().decode()
    assert re.search(r'pdcluster_retries_total\{role="prefill"\} 2\.0', metrics), metrics  # both were tried
    assert re.search(r'pdcluster_requests_total\{endpoint="completions",outcome="no_replica"\} 1\.0', metrics)
    assert all(r.inflight_requests == 0 for r in router.replicas.values())  # nothing leaked


async def _post_raw(router: Router, content: bytes) -> httpx.Response:
    url = await router.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    finally:
        await router.stop()


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}", "nests deeper"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "not usable JSON"),
        (b'{"model": "tiny", "prompt": "x", "n": 1e400}', "1e400 is out of range"),
        (b'{"model": "tiny", "prompt": "x", "n": 0}', "'n' must be an integer"),
        # What Python's JSON reads but no engine request may carry (httpx refuses to send it on)
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
        (b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', "1e999 is out of range"),
        # Fields the router itself reads on the P/D path (the first token from the prefill)
        (b'{"model": "tiny", "prompt": "x", "stream": true, "min_tokens": "3"}', "'min_tokens' must be"),
        (b'{"model": "tiny", "prompt": "x", "min_tokens": 10, "max_tokens": 5}', "must not exceed the output limit"),
        # completions' own default limit, 16 (vLLM alone: a 400; through P/D: a 200, then an error)
        (b'{"model": "tiny", "prompt": "x", "stream": true, "min_tokens": 20}', "the output limit (16)"),
        (b'{"model": "tiny", "prompt": "x", "stream": true, "stream_options": true}', "'stream_options' must be"),
        # KV controls vLLM reads from extra_args, past the router's own kv_transfer_params check
        (b'{"model": "tiny", "prompt": "x", "vllm_xargs": {"kv_transfer_params": "x"}}', "set by the cluster"),
        (b'{"model": "tiny", "prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "full"}}', "set by the cluster"),
        (b'{"model": "tiny", "prompt": "x", "vllm_xargs": [1]}', "'vllm_xargs' must be an object"),
    ],
)
def test_deep_nesting_and_huge_numbers_are_400_not_500(content, needle):
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    response = asyncio.run(_post_raw(router, content))
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize(("stream", "status"), [(b"null", 503), (b'"yes"', 400)])
def test_a_null_stream_is_not_streamed_as_openai_and_vllm_read_it(stream, status):
    """Clients that send unset optional fields as null got a 400 for `"stream": null`; it is
    read as not streamed (here: no replica to answer, a 503), and a non-boolean is still a 400."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    response = asyncio.run(_post_raw(router, b'{"model": "tiny", "prompt": "x", "stream": ' + stream + b"}"))
    assert response.status_code == status, response.text
    assert (status == 400) == ("'stream' must be a boolean" in response.json()["error"]["message"])


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404)]
)
def test_an_unknown_path_or_method_is_an_openai_style_error(method, path, status):
    async def call() -> httpx.Response:
        url = await router.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return await client.request(method, path, json={"model": "tiny"})
        finally:
            await router.stop()

    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    response = asyncio.run(call())
    assert response.status_code == status
    assert response.json()["error"]["message"].endswith(f"({method} {path})"), response.text


def test_aggregated_replicas_unreachable_gives_503():
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, mode="aggregated", phase_attempts=2))
    router.update_replicas([row("aggregated-0", "aggregated")])
    response = asyncio.run(
        _call(
            router,
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    )
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
        router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, tokenizer_path=model))
        await router.start("127.0.0.1", 0)  # returns without waiting for the tokenizer
        try:
            await router.tokens.loading
            counted = [await router.tokens.count({"prompt": text}, "completions") for text in (short, long)]
            by_ids = await router.tokens.count({"prompt": [1, 2, 3]}, "completions")
        finally:
            await router.stop()
        return counted, by_ids

    counted, by_ids = asyncio.run(scenario())
    assert counted == [len(reference(short)["input_ids"]), len(reference(long)["input_ids"])]
    assert by_ids == 3


def test_a_tokenizer_that_does_not_load_leaves_the_router_estimating(tmp_path, caplog):
    async def scenario():
        router = Router(
            RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, tokenizer_path=str(tmp_path / "missing"))
        )
        await router.start("127.0.0.1", 0)
        try:
            await router.tokens.loading
            return await router.tokens.count({"prompt": "x" * 400}, "completions")
        finally:
            await router.stop()

    assert asyncio.run(scenario()) == 100
    assert "did not load" in caplog.text


# -- relaying a replica's SSE stream ---------------------------------------------------------

EVENTS = [
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"h\u00e9llo"}]}',
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" w\u00f6rld"}]}',
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"!"}]}',
    "data: [DONE]",
]


def test_sse_events_split_at_every_byte_boundary():
    from pdcluster.orchestrator.router import SSEEvents

    stream = (EVENTS[0] + "\n\n" + EVENTS[1] + "\r\n\r\n" + EVENTS[2] + "\n\n\n\n" + EVENTS[3]).encode()
    for cut in range(len(stream) + 1):
        events = SSEEvents()
        got = events.feed(stream[:cut]) + events.feed(stream[cut:]) + events.flush()
        assert got == [[e] for e in EVENTS], cut
    events = SSEEvents()
    assert events.feed(b"data: a\ndata: b\n\nda") == [["data: a", "data: b"]]  # a two-line event
    assert events.feed(b"ta: c\n\n") == [["data: c"]] and events.flush() == []


class _SSEReplica:
    """A replica speaking HTTP/1.1 on 127.0.0.1 that writes an SSE stream in awkward pieces: a
    character split across writes, two events in one write, and the third event only once the
    client has received the second (a relay that waits for more input before passing on what it
    has never gets there)."""

    def __init__(self, client_has_second: asyncio.Event):
        self.client_has_second = client_has_second

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        async def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        first = EVENTS[0].encode()
        split = first.index("\u00e9".encode()) + 1  # inside the two bytes of the character
        await chunk(first[:split])
        await chunk(first[split:] + b"\n\n" + EVENTS[1].encode() + b"\r\n\r\n")
        await asyncio.wait_for(self.client_has_second.wait(), 20)
        await chunk(EVENTS[2].encode() + b"\n\n" + EVENTS[3].encode())  # no closing blank line
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()


def test_relay_passes_each_event_on_as_soon_as_it_is_complete():
    async def scenario():
        has_second = asyncio.Event()
        replica = await asyncio.start_server(_SSEReplica(has_second).serve, "127.0.0.1", 0)
        port = replica.sockets[0].getsockname()[1]
        router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN, mode="aggregated"))
        router.update_replicas([{**row("aggregated-0", "aggregated"), "url": f"http://127.0.0.1:{port}"}])
        url = await router.start("127.0.0.1", 0)
        lines = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"model": "tiny", "prompt": "def f():", "max_tokens": 3, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if line == EVENTS[1]:
                            has_second.set()
        finally:
            await router.stop()
            replica.close()
        return lines, router

    lines, router = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [line for line in lines if line] == EVENTS
    assert lines.count("") == len(EVENTS)  # every event closed by its blank line, the last one too
    metrics = router.metrics.exposition().decode()
    assert re.search(r'pdcluster_requests_total\{endpoint="completions",outcome="ok"\} 1\.0', metrics), metrics
    assert all(r.inflight_requests == 0 for r in router.replicas.values())


def test_a_replica_that_left_takes_its_series_and_latency_window_with_it():
    """Every replica id ever seen kept its `pdcluster_replica_inflight` series in /metrics and its
    latency window (status sorts them on every call); replacements and the planner's adds come
    under new ids, so both grew for the router's life. A replica that left, with nothing in flight
    on it, leaves neither behind; one still serving keeps them."""
    from pdcluster.orchestrator.metrics import RouterMetrics
    from pdcluster.orchestrator.router.pool import ReplicaPool

    metrics = RouterMetrics(lambda: [])
    pool = ReplicaPool("least_loaded", metrics)
    pool.update([row("decode-0", "decode"), row("decode-1", "decode")])
    for rid in ("decode-0", "decode-1"):
        replica = pool.replicas[rid]
        pool.enter(replica, 10)
        metrics.window(rid).ttft.add(0.1)
        pool.leave(replica, 10)
    pool.update([row("decode-1", "decode")])  # decode-0 was stopped
    text = metrics.exposition().decode()
    assert 'replica="decode-0"' not in text and 'pdcluster_replica_inflight{replica="decode-1"' in text
    assert set(metrics.windows) == {"decode-1"}


def test_a_client_gone_while_sending_its_body_is_cancelled_not_an_internal_error(caplog):
    """A client that closes its connection halfway through its request body: Starlette raises
    ClientDisconnect, which reached the router's last-resort handler (an ERROR with a traceback,
    a 500 built for nobody, no request counted). It is counted as cancelled, quietly."""
    import logging
    import socket
    import time

    async def scenario() -> float:
        url = await router.start("127.0.0.1", 0)
        try:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall((head + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": "tiny", "pro')
            line = 'pdcluster_requests_total{endpoint="completions",outcome="cancelled"}'
            deadline = time.monotonic() + 10
            while line not in router.metrics.exposition().decode() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the router notices the closed connection
            return float(router.metrics.exposition().decode().split(line)[1].split()[0])
        finally:
            await router.stop()

    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(scenario()) == 1.0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def abandoned(run, working: str, leave, client_timeout_s: float = 1.0) -> Router:
    """One request through a router whose `working` replica ("prefill" or "decode") answers
    nothing until the router hangs up on it; `leave(client)` sends the request and gives up on it
    (a client whose reads time out after `client_timeout_s`).
    The router, once that replica saw the router hang up (nothing left in flight)."""
    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    hung_up = asyncio.Event()

    async def working_forever(call, out):
        await out.until_the_router_hangs_up()
        hung_up.set()

    answers = {"prefill": prefill_answer(), "decode": decode_answer, working: working_forever}
    prefill, decode = StandIn(answers["prefill"]), StandIn(answers["decode"])

    async def scenario():
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        try:
            async with httpx.AsyncClient(base_url=url, timeout=client_timeout_s) as client:
                await leave(client)
            await asyncio.wait_for(hung_up.wait(), 20)
        finally:
            await router.stop()
            prefill.close()
            decode.close()

    run(scenario, 60)
    assert all(r.inflight_requests == 0 for r in router.replicas.values())
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="ok"}') == 0
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="cancelled"}') == 1
    return router


def test_a_client_that_leaves_a_non_streamed_request_abandons_it_on_the_engine(run):
    """The router's connection to the decode replica closes when its client goes away (vLLM
    aborts a request whose connection closed): the engine does not work on for nobody."""

    async def leave(client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=COMPLETION)  # the client gives up

    abandoned(run, "decode", leave)


def test_a_client_that_leaves_a_stream_before_decode_answers_abandons_it_on_the_engine(run):
    """A stream whose client leaves after the prefill's first token, while the decode replica
    has not answered yet: the router's connection to decode closes (vLLM aborts the request) and
    the request counts as cancelled. The client's going cancelled the router's task again each
    turn of the loop (anyio's cancel scope), each cancel reaching the call to decode awaited
    there, which broke off httpcore's close of its connection: the engine generated on for
    nobody, and the request counted as ok."""

    async def leave(client):
        async with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # the prefill's first token came: the client leaves

    abandoned(run, "decode", leave, client_timeout_s=20.0)


def test_a_client_that_leaves_a_stream_while_its_prefill_runs_abandons_it_on_the_engine(run):
    """A stream's response starts once its prefill is done; a client that gave up before (its
    prefill queued or long) went unnoticed until then: the prefill engine worked on for nobody,
    for up to a read timeout. The router now watches the client from the start, as it does for
    a non-streamed request."""

    async def leave(client):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting for the stream
            async with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}):
                pass

    abandoned(run, "prefill", leave)


def test_a_router_stopped_with_a_stream_open_cuts_it_before_closing_its_replica_connections(run, caplog):
    """`down` stops the router while streams are open: it waited 10 s for them, then closed its
    client to the replicas under them and left them running on it (a stream then failed on the
    closed client, moving to another decode replica). Open requests get a grace period; then they
    are cut as if their clients had left (the replica's request abandoned, counted cancelled),
    and only then do the router's connections to the replicas close."""
    import logging

    hung_up = asyncio.Event()

    async def stalled_stream(call, out):
        await out.sse(
            ['data: {"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":" t0"}]}'], keep_open=True
        )
        await out.until_the_router_hangs_up()
        hung_up.set()

    router = Router(RouterSettings(model_name="tiny", engine_token=ENGINE_TOKEN))
    prefill, decode = StandIn(prefill_answer()), StandIn(stalled_stream)

    async def scenario() -> tuple[bool, list[str]]:
        url = await running(router, prefill, decode)
        router.update_replicas([row("prefill-0", "prefill", prefill.url), row("decode-0", "decode", decode.url)])
        lines = []
        try:
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as response,
            ):
                async for line in response.aiter_lines():
                    lines.append(line)
                    if " t0" in line:  # decode is streaming: the router stops
                        await router.stop(grace_s=0.5)
                        return hung_up.is_set(), lines
        finally:
            prefill.close()
            decode.close()
        return False, lines

    with caplog.at_level(logging.WARNING):
        abandoned_first, lines = run(scenario, 60)
    assert abandoned_first, lines  # the replica's request was abandoned before stop returned
    assert metric(router, 'pdcluster_requests_total{endpoint="completions",outcome="cancelled"}') == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("pdcluster")]
    assert not errors, caplog.text
    assert all(r.inflight_requests == 0 for r in router.replicas.values())
