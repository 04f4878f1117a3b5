"""Mid-stream decode failover: a stream whose decode replica dies goes on on another one.

The router asks every decode stream for its token ids (`return_token_ids`) and keeps, per
stream, the prompt's ids and the ids of every token already relayed to the client (`Progress`).
When the upstream breaks before the answer finished, another decode replica is asked to continue
from exactly there: a completions request over the prompt plus those tokens, that many fewer to
generate (`resume_body`); it computes that prefix itself (no prefill, no lease) and its events are
rewritten as the client's own stream (continuation.rewrite: the first response's id, chat format
for chat, usage counting what came before). Greedy output is the same token for token as an
undisturbed run. The ids are stripped from what the client gets. `relayed` is the decode stream
as the client gets it, moved as often as the limit allows.

Only requests whose meaning survives the split migrate (the continuation path's rules, without a
seed: a resumed sampler would start a fresh generator); others end with an SSE error event, as
do streams past `router.migration_limit` migrations or with no decode replica left.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from pdcluster.errors import NoReplicaError, PDClusterError, ReplicaError
from pdcluster.orchestrator.policies import ReplicaLoad
from pdcluster.orchestrator.router import continuation
from pdcluster.orchestrator.router.bodies import answer_body
from pdcluster.orchestrator.router.relay import (
    Relay,
    Rewrite,
    StreamBroke,
    TokenClock,
    error_event,
    mid_stream_error,
    relay_events,
)
from pdcluster.orchestrator.router.upstream import PhaseFailed, post

if TYPE_CHECKING:
    from pdcluster.orchestrator.router.handoff import Handoff, PhaseRunner

logger = logging.getLogger(__name__)


def resumable(body: dict[str, Any], kind: str, defaults: dict[str, Any], max_model_len: int | None = None) -> bool:
    """Can a broken stream of this request continue on another decode replica?"""
    if body.get("stream") is not True:
        return False
    # continuable() also asks for two tokens at least: a one-token stream may still resume (none
    # is left only once it ended, and then nothing is resumed).
    limit = continuation.output_limit(continuation.with_defaults(body, kind, defaults), kind)
    probe = body if limit is None else {**body, "max_tokens": max(2, limit), "max_completion_tokens": None}
    return continuation.continuable(probe, kind, defaults, max_model_len) and (limit is None or limit >= 1)


def progress_for(
    body: dict[str, Any],
    kind: str,
    defaults: dict[str, Any],
    first: continuation.FirstToken | None,
    restartable: bool,
    max_model_len: int | None = None,
) -> Progress | None:
    """The progress to track of a decode stream (None: it cannot migrate): after the prefill's
    first token when there is one; `restartable` when decode computes the request alone."""
    if not resumable(body, kind, defaults, max_model_len):
        return None
    if first is not None:
        return Progress.after_first_token(first)
    return Progress(restartable=restartable)


@dataclass
class Progress:
    """What of one stream the client already has."""

    prompt_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finished: bool = False  # an event carried a finish_reason: nothing is left to generate
    header: continuation.FirstToken | None = None  # the first response's id, created, model
    restartable: bool = False  # no lease to pull: the request may start over on another replica
    settled: int = 0  # of `generated`, the tokens whose text the client has (see back_off)

    @classmethod
    def after_first_token(cls, first: continuation.FirstToken) -> Progress:
        return cls(list(first.prompt_ids), [first.token_id], header=first, settled=1)

    def back_off(self) -> None:
        """Forget the tokens after the last one whose text reached the client: the first bytes
        of a character, which vLLM's detokenizer holds back (their events carry no text). A
        stream resumed after them would be detokenized from its start: the client would get the
        whole prompt's text again. Resumed before them, they are generated again and their
        text comes with the rest of the character. (A chunk of several tokens, under MTP, counts
        as settled when it has text: a character begun by its last token is not seen.)"""
        del self.generated[self.settled :]

    def observe(self, event: dict[str, Any]) -> dict[str, Any]:
        """Note an event of the stream (as the replica sent it) and return it as the client gets
        it: without the ids the router asked for (a request that asks for them itself does not
        migrate: `return_token_ids` is not a continuable field)."""
        prompt = event.get("prompt_token_ids")
        for choice in event.get("choices") or ():
            prompt = prompt or choice.get("prompt_token_ids")
            self.generated.extend(int(t) for t in choice.get("token_ids") or ())
            delta = choice.get("delta") or {}  # chat: content, or reasoning where a parser splits it
            if choice.get("text") or any(value for key, value in delta.items() if key != "role"):
                self.settled = len(self.generated)
            if choice.get("finish_reason") is not None:
                self.finished = True
        if prompt and not self.prompt_ids:
            self.prompt_ids = [int(t) for t in prompt]
        if self.header is None and event.get("id"):
            self.header = continuation.FirstToken(
                token_id=-1,
                text="",
                prompt_ids=self.prompt_ids,
                response_id=str(event["id"]),
                created=int(event.get("created", 0)),
                model=str(event.get("model", "")),
            )
        for key in continuation.TOKEN_FIELDS:
            event.pop(key, None)
        for choice in event.get("choices") or ():
            for key in continuation.TOKEN_FIELDS:
                choice.pop(key, None)
        return event

    @property
    def can_resume(self) -> bool:
        return bool(self.prompt_ids) and self.header is not None and not self.finished

    @property
    def can_restart(self) -> bool:
        """A request decode computes alone (local prefill, no prefill replica) whose stream broke
        before any event reached the client (the replica died computing the prompt): it starts
        over on another replica, as it was."""
        return self.restartable and self.header is None and not self.generated and not self.finished


def rewrite_after(progress: Progress, kind: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The rewrite that makes a resumed stream's events the rest of the client's own stream."""
    return functools.partial(continuation.rewrite, kind=kind, first=progress.header, generated=len(progress.generated))


def resume_body(
    body: dict[str, Any], kind: str, progress: Progress, defaults: dict[str, Any], max_model_len: int | None = None
) -> dict[str, Any]:
    """The request that continues a broken stream on another decode replica."""
    body = continuation.with_defaults(body, kind, defaults)
    out = {
        key: value
        for key, value in body.items()
        if key in continuation.CONTINUABLE_FIELDS and key not in ("max_tokens", "max_completion_tokens", "min_tokens")
    }
    done = len(progress.generated)
    limit = continuation.output_limit(body, kind)
    context = [*progress.prompt_ids, *progress.generated]
    out["max_tokens"] = continuation.tokens_left(len(context), max_model_len) if limit is None else max(1, limit - done)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - done)
    out.update(prompt=context, stream=True, return_token_ids=True)
    return out


async def relayed(
    runner: PhaseRunner,
    h: Handoff,
    relay: Relay,
    upstream: httpx.Response | None,
    clock: TokenClock,
    rewrite: Rewrite | None,
    progress: Progress | None,
    broken: BaseException | None = None,
    chunks: AsyncIterator[bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The decode replica's stream to the client; if it breaks mid-stream, the rest comes from
    another decode replica, up to `migration_limit` times. `upstream` None:
    the replica failed before answering (`broken` says how); the stream moves at once. `chunks`:
    the upstream's bytes when some were read already (relay.first_event)."""
    moves = 0
    while True:
        assert h.answering is not None
        failed = h.answering
        if upstream is None:
            assert broken is not None
            cause: BaseException = broken
        else:
            try:
                read, chunks = chunks or upstream.aiter_bytes(), None
                async for chunk in relay_events(read, failed.replica_id, h, clock, rewrite, progress):
                    yield chunk
                return
            except StreamBroke as broke:
                cause = broke.cause
        assert progress is not None
        restart = progress.can_restart  # nothing reached the client: the request starts over
        moved: httpx.Response | None = None
        while moved is None and moves < runner.settings.migration_limit:
            moves += 1
            try:
                moved = await _move(runner, h, relay, progress, failed)
            except NoReplicaError as exc:
                cause = exc
                break
            except (PDClusterError, PhaseFailed, httpx.HTTPError) as exc:
                cause, failed = exc, h.answering or failed
        if moved is None:
            runner.metrics.migrations.labels("failed").inc()
            h.outcome = "upstream_error"
            yield error_event(mid_stream_error(failed.replica_id, cause), "upstream_error", 502)
            return
        runner.metrics.migrations.labels("ok").inc()
        upstream = moved
        rewrite = None if restart else rewrite_after(progress, h.kind)


async def _move(
    runner: PhaseRunner, h: Handoff, relay: Relay, progress: Progress, failed: ReplicaLoad
) -> httpx.Response:
    """Continue the stream on another decode replica: its answer's headers are in."""
    assert runner.http is not None
    if relay.upstream is not None:
        await relay.upstream.aclose()
        relay.upstream = None
    h.drop(failed)
    h.excluded.setdefault("decode", []).append(failed.replica_id)
    h.answering = h.choose("decode")  # NoReplicaError when none is left
    if progress.can_restart:
        path, body = h.path, answer_body(h.body, h.params, progress is not None)
    else:
        path = continuation.CONTINUATION_PATH
        progress.back_off()
        body = resume_body(h.body, h.kind, progress, runner.settings.generation_defaults, runner.settings.max_model_len)
    logger.warning(
        "decode replica %s failed mid-stream after %d tokens; continuing on %s",
        failed.replica_id,
        len(progress.generated),
        h.answering.replica_id,
    )
    upstream = await post(runner.http, h.answering, path, body, True, h.request_id)
    if upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        raise ReplicaError(f"decode replica {h.answering.replica_id} refused the migrated stream: {content[:200]!r}")
    relay.upstream = upstream
    return upstream
