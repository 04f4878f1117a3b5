"""Relaying a replica's SSE stream to the client: events split as they arrive, each data event
parsed once (that one object tells a token from an error and is what a continuation rewrites),
time to first token and inter-token gaps as the client sees them, and the stream's cleanup."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import StreamingResponse

from pdcluster.orchestrator.metrics import RouterMetrics

if TYPE_CHECKING:
    from pdcluster.orchestrator.router.handoff import Handoff
    from pdcluster.orchestrator.router.migration import Progress

logger = logging.getLogger(__name__)

Rewrite = Callable[[dict[str, Any]], dict[str, Any]]  # one parsed event -> the event the client gets


class SSEEvents:
    """Bytes of a server-sent-event stream -> its complete events, each as its lines (an event
    ends at a blank line; a multi-byte character cannot straddle one, so events decode whole)."""

    _END = re.compile(rb"\r?\n\r?\n")

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[list[str]]:
        parts = self._END.split(self._pending + data)
        self._pending = parts.pop()
        return [part.decode(errors="replace").splitlines() for part in parts if part.strip()]

    def flush(self) -> list[list[str]]:
        """What is left once the stream ended (an event without its closing blank line)."""
        rest, self._pending = self._pending, b""
        return [rest.decode(errors="replace").splitlines()] if rest.strip() else []


def has_token(event: dict[str, Any]) -> bool:
    """Does this parsed event carry generated text (not the role header, usage or an error)?"""
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


DONE = b"data: [DONE]\n\n"


def error_event(message: str, err_type: str, code: int) -> bytes:
    """An OpenAI-style error as the last SSE event: how a stream that already began reports a
    failure, ended as vLLM ends one (its error shape, then `[DONE]`)."""
    error = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\n".encode() + DONE


def upstream_error_event(raw: bytes, status: int) -> bytes:
    """A replica's error answer (not streamed) as the stream's last event: its own OpenAI error
    when it is one, else its text in one."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"data: {json.dumps(body)}\n\n".encode() + DONE
    return error_event(raw.decode(errors="replace")[:2000] or f"HTTP {status}", "upstream_error", status)


def mid_stream_error(replica_id: str, exc: BaseException) -> str:
    return f"upstream replica {replica_id} failed mid-stream: {exc}"


class TokenClock:
    """TTFT and inter-token gaps of one relayed stream, as the client sees them: tokens that
    leave in one write reach the client together. `handoff`: the stream starts with the
    prefill's first token, so its first gap is also the handoff gap (metrics.handoff_gap)."""

    def __init__(self, metrics: RouterMetrics, replica_id: str, started: float, handoff: bool = False):
        self.metrics, self.window, self.started = metrics, metrics.window(replica_id), started
        self.last: float | None = None
        self._handoff = handoff

    def tokens(self, count: int) -> None:
        """`count` tokens are about to be written to the client."""
        if not count:
            return
        now = time.perf_counter()
        cluster = self.metrics.cluster
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
            self.window.ttft.add(now - self.started)
            cluster.ttft.add(now - self.started)
        else:
            self.metrics.itl.observe(now - self.last)
            self.window.itl.add(now - self.last)
            cluster.itl.add(now - self.last)
            if self._handoff:
                self._handoff = False
                self.metrics.handoff_gap.observe(now - self.last)
        for _ in range(count - 1):
            self.metrics.itl.observe(0.0)
            self.window.itl.add(0.0)
            cluster.itl.add(0.0)
        self.last = now


def settle(pending: asyncio.Future) -> httpx.Response | None:
    """An upstream request no longer awaited: cancelled if still on its way, else its answer
    (None when it failed), for the caller to close."""
    if not pending.done():
        pending.cancel()
        return None
    if pending.cancelled() or pending.exception() is not None:
        return None
    return pending.result()


class Relay:
    """Cleanup of one relayed stream, run exactly once however the response ends: normally,
    on a broken upstream, on a client disconnect mid-stream, or before the first byte. It ends
    the request's hold on its replicas and records its outcome."""

    def __init__(self, handoff: Handoff, upstream: httpx.Response | None = None):
        self.handoff, self.upstream = handoff, upstream
        self.pending: asyncio.Future | None = None  # the upstream request while it is on its way
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.upstream is None and self.pending is not None:
                self.upstream = settle(self.pending)
            if self.upstream is not None:
                await self.upstream.aclose()  # closing upstream aborts the engine's request
        finally:
            self.handoff.release()
            self.handoff.finish()


class RelayResponse(StreamingResponse):
    """A streaming response that always runs its relay's cleanup, even when the client is gone
    before the body iterator ever started (an unstarted generator never runs its `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], relay: Relay, headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


def whole_stream(handoff: Handoff, clock: TokenClock, events: list[dict[str, Any]]) -> StreamingResponse:
    """A stream the router has whole (a prefill's answer that ended the request) in one write,
    ended with [DONE]; the request ends here (its holds end as the response is returned)."""
    clock.tokens(sum(map(has_token, events)))
    handoff.finish()
    data = "".join(f"data: {json.dumps(event)}\n\n" for event in events).encode() + DONE
    headers = {"Cache-Control": "no-cache", **handoff.served_by()}
    return StreamingResponse(iter([data]), media_type="text/event-stream", headers=headers)


async def closing(relay: Relay, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks`, then the relay's cleanup, which so runs before the response's final write."""
    try:
        async for chunk in chunks:
            yield chunk
    except asyncio.CancelledError:
        # The client went away: wherever the stream was (relaying, or moving to another decode
        # replica), closing the relay aborts the engine's request.
        relay.handoff.outcome = "cancelled"
        raise
    finally:
        await relay.close()


class StreamBroke(Exception):
    """The upstream broke mid-stream and what the client has can be continued elsewhere."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def error_outcome(error: Any) -> str:
    """The `pdcluster_requests_total` outcome of a replica's error answer: a decode engine whose
    KV pull failed says so itself (engine/kv_errors.py)."""
    return (
        "kv_transfer_error"
        if isinstance(error, dict) and error.get("type") == "kv_transfer_error"
        else "upstream_error"
    )


async def relay_events(
    chunks: AsyncIterator[bytes],
    replica_id: str,
    handoff: Handoff,
    clock: TokenClock,
    rewrite: Rewrite | None = None,
    progress: Progress | None = None,
) -> AsyncIterator[bytes]:
    """The replica's SSE events (`chunks`: its stream's bytes) to the client: each event
    rewritten (`rewrite`: a continuation as the client's own request), an error event counted by
    what it is, a broken upstream ended
    with an error event, or, when `progress` (what the client has, migration.py) can be resumed
    or nothing reached the client yet, with StreamBroke for the caller to continue the stream
    elsewhere.

    Every complete event of one upstream read leaves in one write: nothing waits for more input,
    and the client is not woken once per line (each write is a syscall here and a read there, on
    the cores the engines use)."""
    events = SSEEvents()
    try:
        async for data in chunks:
            ended = False
            if batch := events.feed(data):
                yield _relay_batch(batch, handoff, clock, rewrite, progress)
                ended = batch[-1] == ["data: [DONE]"]
            if not ended and time.perf_counter() > handoff.deadline:  # the whole request's bound, not one read's
                handoff.outcome = "timeout"
                yield error_event("request exceeded router.request_timeout_seconds", "timeout", 504)
                return
        if batch := events.flush():
            yield _relay_batch(batch, handoff, clock, rewrite, progress)
    except (httpx.HTTPError, OSError) as exc:
        logger.error("stream from %s broke: %s", replica_id, exc)
        if progress is not None and (progress.can_resume or progress.can_restart):
            raise StreamBroke(exc) from exc
        handoff.outcome = "upstream_error"
        yield error_event(mid_stream_error(replica_id, exc), "upstream_error", 502)
    except asyncio.CancelledError:
        handoff.outcome = "cancelled"  # client went away; closing upstream aborts the engine request
        raise


async def first_event(upstream: httpx.Response) -> tuple[dict[str, Any] | None, AsyncIterator[bytes]]:
    """Read a stream up to its first complete event: (that event parsed, when it is a data event
    with a JSON object; the stream's bytes from its start, to relay as they would have been)."""
    chunks = upstream.aiter_bytes()
    head: list[bytes] = []
    events = SSEEvents()
    batch: list[list[str]] = []
    broke: BaseException | None = None
    try:
        async for data in chunks:
            head.append(data)
            if batch := events.feed(data):
                break  # the generator stays open: the rest is read below
        else:
            batch = events.flush()
    except (httpx.HTTPError, OSError) as exc:
        broke = exc  # raised where the relay reads it, as if it had read the stream itself

    async def replay() -> AsyncIterator[bytes]:
        for data in head:
            yield data
        if broke is not None:
            raise broke
        async for data in chunks:
            yield data

    data_lines = [line for line in (batch[0] if batch else ()) if line.startswith("data: {")]
    return (_data(data_lines[0]) if data_lines else None), replay()


def _data(line: str) -> dict[str, Any] | None:
    """A `data: {...}` line's JSON object (None if it is not one)."""
    try:
        data = json.loads(line[6:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _relay_batch(
    batch: list[list[str]], handoff: Handoff, clock: TokenClock, rewrite: Rewrite | None, progress: Progress | None
) -> bytes:
    out: list[str] = []
    tokens = 0
    for event in batch:
        for line in event:
            if line.startswith("data: {") and (data := _data(line)) is not None:
                if "error" in data:
                    handoff.outcome = error_outcome(data["error"])
                else:
                    tokens += has_token(data)
                    if progress is not None:
                        data = progress.observe(data)
                    if rewrite is not None:
                        data = rewrite(data)
                    if progress is not None or rewrite is not None:
                        line = "data: " + json.dumps(data)
            out.append(line)
            out.append("\n")
        out.append("\n")
    clock.tokens(tokens)
    return "".join(out).encode()
