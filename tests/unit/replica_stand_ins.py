"""Stand-in replicas for the router's unit tests: real HTTP/1.1 servers on 127.0.0.1 (plain asyncio,
no engine) that record what the router sent them and answer as a prefill or decode replica would,
or fail in the ways a real one can (refuse the connection, hang up without answering)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import uvloop

from pdcluster.engine.kv_events import EVENTS_PATH
from pdcluster.kv_transfer.params import KVParams
from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router import Router

PROMPT_IDS = [11, 12, 13]
COMPLETION = {"model": "tiny", "prompt": "def f():", "max_tokens": 4}  # a client's request
# The event loops the router runs on: asyncio's own, and uvloop's (Ray's actors use it).
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def closed_port() -> int:
    """A port nothing listens on (bound, then released): connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row(replica_id: str, role: str, url: str | None = None, state: ReplicaState = ReplicaState.READY) -> dict:
    """A replica as the controller describes it to the router (unreachable unless `url`)."""
    return {
        "replica_id": replica_id,
        "role": role,
        "url": url or f"http://127.0.0.1:{closed_port()}",
        "state": int(state),
        "node": "127.0.0.1",
        "stats": {},
    }


# The engine key the router is given in these tests; a stand-in answers 401 to any call without
# it, as a real engine's app does (pdcluster/engine/http_auth.py).
ENGINE_TOKEN = "stand-in-engine-key"


@dataclass
class Call:
    method: str
    path: str
    body: dict | None
    request_id: str | None  # the X-Request-Id header
    authorization: str | None = None


class Writer:
    """The stand-in's side of one answer."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader | None = None):
        self._writer, self._reader = writer, reader

    async def until_the_router_hangs_up(self) -> None:
        """Answer nothing; return once the router closed the connection (it gave up on us)."""
        assert self._reader is not None
        while await self._reader.read(65536):
            continue

    async def json(self, payload: dict, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self._writer.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(data), data)
        )
        await self._writer.drain()

    async def sse(self, events: list[str], *, then_hang_up: bool = False, keep_open: bool = False) -> None:
        """Each event ("data: ...") in its own chunk, as vLLM's server writes one per token;
        `then_hang_up`: the connection closes after them, mid-stream (a replica that died);
        `keep_open`: the stream stays open after them, unfinished (a replica gone silent)."""
        self._writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            data = (event + "\n\n").encode()
            self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self._writer.drain()
        if then_hang_up:
            self._writer.close()
            return
        if keep_open:
            return
        self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()

    def hang_up(self) -> None:
        """Close the connection having read the request, without a byte of answer."""
        self._writer.close()


Answer = Callable[[Call, Writer], Awaitable[None]]


@dataclass
class StandIn:
    answer: Answer
    calls: list[Call] = field(default_factory=list)
    url: str = ""
    _server: asyncio.Server | None = None

    async def start(self) -> StandIn:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def posts(self) -> list[Call]:
        return [c for c in self.calls if c.method == "POST"]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not writer.is_closing():
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ", 2)[:2]
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                raw = await reader.readexactly(int(length.group(1))) if length else b""
                request_id = re.search(rb"(?i)x-request-id: *(\S+)", head)
                authorization = re.search(rb"(?i)authorization: *([^\r]+)", head)
                call = Call(
                    method.decode(),
                    target.decode(),
                    json.loads(raw) if raw else None,
                    request_id.group(1).decode() if request_id else None,
                    authorization.group(1).decode() if authorization else None,
                )
                if call.path == EVENTS_PATH:  # publishes no KV events, as an engine without them
                    await Writer(writer).json({"detail": "Not Found"}, 404)
                    continue
                self.calls.append(call)
                if call.authorization != f"Bearer {ENGINE_TOKEN}":
                    await Writer(writer).json({"error": {"message": "no engine key", "code": 401}}, 401)
                    continue
                await self.answer(call, Writer(writer, reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the router closed its connection: nothing more to answer
        finally:
            writer.close()


def lease_of(body: dict) -> int:
    """Which of the prefill stand-in's leases a decode request carries (0: none yet, a
    continuation sent ahead of its prefill)."""
    params = body["kv_transfer_params"]
    return int(params["remote_request_id"]) if "remote_request_id" in params else 0


def prefill_answer() -> Answer:
    """A prefill replica: every answer carries a new lease (`lease_of` numbers them from 1), and the
    first token (42, " first") with the ids a continuation needs, as vLLM's completions and chat
    answers carry them."""
    leases = iter(range(1, 1000))

    async def answer(call: Call, out: Writer) -> None:
        params = KVParams("prefill", str(next(leases)), ("127.0.0.1:1",), (0,), len(PROMPT_IDS), 1e10).to_dict()
        choice = {"index": 0, "finish_reason": "length", "token_ids": [42]}
        answer = {"id": "cmpl-p", "created": 1, "model": "tiny", "choices": [choice], "kv_transfer_params": params}
        if call.path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": " first"}
            answer["prompt_token_ids"] = PROMPT_IDS
        else:
            choice.update(text=" first", prompt_token_ids=PROMPT_IDS)
        await out.json(answer)

    return answer


async def decode_answer(call: Call, out: Writer) -> None:
    """A decode replica: JSON or a three-token stream, naming the lease it was sent."""
    lease = lease_of(call.body)
    if not call.body.get("stream"):
        await out.json({"id": "cmpl-d", "choices": [{"index": 0, "text": f"decoded lease {lease}"}]})
        return
    events = [
        json.dumps(
            {
                "id": "cmpl-d",
                "object": "text_completion",
                "created": 2,
                "model": "tiny",
                "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
            }
        )
        for i in range(3)
    ]
    await out.sse([f"data: {e}" for e in events] + ["data: [DONE]"])


async def hang_up(call: Call, out: Writer) -> None:
    out.hang_up()


async def running(router: Router, *stand_ins: StandIn) -> str:
    for stand_in in stand_ins:
        await stand_in.start()
    return await router.start("127.0.0.1", 0)


async def post(url: str, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
    """POST to the router; a streamed answer's lines are read to its end."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", path, json=body) as response,
    ):
        raw = await response.aread()
    return response, raw.decode().splitlines()


def metric(router: Router, pattern: str) -> float:
    """The value of the router's metric line that starts with `pattern` (0 when absent)."""
    found = re.search(pattern.replace("{", r"\{").replace("}", r"\}") + r" (\S+)", router.metrics.exposition().decode())
    return float(found.group(1)) if found else 0.0


def data(lines: list[str]) -> list[dict]:
    """The JSON events of an SSE stream's lines."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def token_events(tokens: list[int], *, start: int = 0, prompt: list[int] | None = None, finish: bool = False):
    """A decode replica's completions stream with token ids (what the router asks for)."""
    events = []
    for i, token in enumerate(tokens):
        choice = {"index": 0, "text": f" t{token}", "finish_reason": None, "token_ids": [token]}
        if i == 0 and prompt is not None:
            choice["prompt_token_ids"] = prompt
        if finish and i == len(tokens) - 1:
            choice["finish_reason"] = "length"
        events.append(
            {"id": f"cmpl-{start}", "object": "text_completion", "created": 2, "model": "tiny", "choices": [choice]}
        )
    return [f"data: {json.dumps(e)}" for e in events]


def dying_decode(tokens: list[int]):
    """A decode replica that streams `tokens` and then hangs up mid-stream."""

    async def answer(call, out):
        await out.sse(token_events(tokens, prompt=PROMPT_IDS), then_hang_up=True)

    return answer


async def resuming_decode(call, out):
    """A decode replica that continues a migrated stream to its end (tokens numbered by position)."""
    done = call.body["prompt"][len(PROMPT_IDS) :]
    left = [100 + i for i in range(len(done), len(done) + call.body["max_tokens"])]
    await out.sse(token_events(left, start=1, prompt=call.body["prompt"], finish=True) + ["data: [DONE]"])
