"""A failed pull's reason on the decode engine's own answer (engine/kv_errors.py), through the
failure channel (kv_transfer/failures.py): a real Unix datagram socket, the report sent from
another process as the connector's worker half does, and the middleware in front of a stand-in
for vLLM's app (500 / an SSE error event, as vLLM answers a request whose load failed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pdcluster.engine.kv_errors import KVErrorAnswers
from pdcluster.kv_transfer.failures import FAILURE_SOCKET_ENV, MAX_KEPT, FailureInbox
from pdcluster.kv_transfer.params import AWAIT, AwaitParams, KVParams


def params(lease: str) -> dict:
    return KVParams("c-prefill-0", lease, ("127.0.0.1:1",), (1, 2), 200, 1e10).to_dict()


async def completions(request):
    body = await request.json()
    if body.get("stream") and AWAIT in (body.get("kv_transfer_params") or {}):

        async def aborted():  # vLLM ends an aborted stream with no event of its own
            yield b"data: [DONE]\n\n"

        return StreamingResponse(aborted(), media_type="text/event-stream")
    if body.get("stream"):

        async def events():
            yield b'data: {"id": "x", "choices": [{"text": "a"}]}\n\n'
            yield b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"error": {"message": "Internal server error", "code": 500}}, status_code=500)


def report_from_another_process(inbox: FailureInbox, lease: str, reason: str, abort: str = "") -> None:
    code = (
        "from pdcluster.kv_transfer.failures import report_failure; "
        f"report_failure({lease!r}, 'c-prefill-0', {reason!r}, abort={abort!r})"
    )
    env = {**os.environ, FAILURE_SOCKET_ENV: inbox.path}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def call(inbox, body):
    app = KVErrorAnswers(
        Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]), inbox, "c-decode-0"
    )

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(go())


def test_a_failed_pull_answers_502_with_its_reason_once():
    inbox = FailureInbox()
    try:
        assert oct(os.stat(os.path.dirname(inbox.path)).st_mode & 0o777) == "0o700"
        report_from_another_process(inbox, "lease-1", "producer unreachable: connection refused")
        response = call(inbox, {"prompt": [1, 2], "kv_transfer_params": params("lease-1")})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "kv_transfer_error"
        assert error["message"] == (
            "KV handoff from c-prefill-0 to c-decode-0 failed and kv_transfer.failure_policy=fail: "
            "producer unreachable: connection refused"
        )
        # Taken once: a later error of the same lease is vLLM's own again.
        assert call(inbox, {"prompt": [1, 2], "kv_transfer_params": params("lease-1")}).status_code == 500
    finally:
        inbox.close()
    assert not os.path.exists(inbox.path)


def test_other_requests_and_other_leases_pass_through():
    inbox = FailureInbox()
    try:
        report_from_another_process(inbox, "lease-2", "timed out")
        assert call(inbox, {"prompt": [1]}).status_code == 500  # no lease: vLLM's answer as is
        assert call(inbox, {"prompt": [1], "kv_transfer_params": params("lease-9")}).status_code == 500
        assert inbox.take("lease-2") == ("c-prefill-0", "timed out", False)
    finally:
        inbox.close()


def test_a_streamed_error_event_carries_the_reason():
    inbox = FailureInbox()
    try:
        report_from_another_process(inbox, "lease-3", "injected KV pull failure")
        response = call(inbox, {"prompt": [1], "stream": True, "kv_transfer_params": params("lease-3")})
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert events[0]["choices"][0]["text"] == "a"
        assert events[1]["error"]["type"] == "kv_transfer_error"
        assert events[1]["error"]["message"].endswith("failure_policy=fail: injected KV pull failure")
        assert response.text.rstrip().endswith("data: [DONE]")
    finally:
        inbox.close()


def test_reports_nobody_reads_never_block_the_sender():
    """A pull thread must not wait on the API process: the inbox reads reports as they come, and
    one that finds its socket full anyway is dropped (the engine's error is then vLLM's own). The
    sender runs in its own process: a blocking send would hang it past the timeout."""
    inbox = FailureInbox()
    try:
        code = (
            "from pdcluster.kv_transfer.failures import report_failure\n"
            "for i in range(3000): report_failure(f'lease-{i}', 'c-prefill-0', 'x' * 1500)\n"
        )
        env = {**os.environ, FAILURE_SOCKET_ENV: inbox.path}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
        kept = [i for i in range(3000 - MAX_KEPT, 3000) if inbox.take(f"lease-{i}")]
        assert kept  # read as they came, the newest MAX_KEPT kept
    finally:
        inbox.close()


def test_a_request_admitted_ahead_whose_lease_never_came_is_aborted_and_says_why():
    """ahead.py gives up on a request whose lease never came: the engine host aborts it (the
    inbox calls on_abort with vLLM's request id) and its stream, which vLLM ends with no event,
    gets the reason as an error event before its end, found by the request's key."""
    aborted: list[str] = []
    inbox = FailureInbox(on_abort=aborted.append)
    key = "e" * 32
    try:
        report_from_another_process(inbox, key, "its prefill's lease did not come", abort="cmpl-1-0-ab")
        inbox.drain()  # the reader thread may have moved it already: on_abort runs once either way
        assert aborted == ["cmpl-1-0-ab"]
        ahead = AwaitParams(key, KVParams.from_dict(params("lease-4")), 1e10).to_dict()
        response = call(inbox, {"prompt": [1], "stream": True, "kv_transfer_params": ahead})
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert len(events) == 1 and events[0]["error"]["type"] == "kv_transfer_error"
        assert events[0]["error"]["message"] == (
            "KV handoff from c-prefill-0 to c-decode-0 failed and no lease came for a request admitted "
            "ahead of its prefill: its prefill's lease did not come"
        )
        assert response.text.rstrip().endswith("data: [DONE]")
    finally:
        inbox.close()


def test_abort_reports_wait_for_room_in_a_full_inbox_instead_of_being_dropped():
    """Aborts of requests admitted ahead whose lease never came (ahead.py gives up every request
    awaiting a failed producer at once): the inbox's reader is held up (in its first on_abort) while
    60 reports arrive, more than the socket queues. Each is delivered once the reader goes on; a
    dropped one left its request holding its blocks until its deadline."""
    go_on, aborted = threading.Event(), []

    def on_abort(request_id: str) -> None:
        go_on.wait(30)
        aborted.append(request_id)

    inbox = FailureInbox(on_abort=on_abort)
    try:
        code = (
            "from pdcluster.kv_transfer.failures import report_failure\n"
            "for i in range(60): report_failure(f'key-{i}', 'c-prefill-0', 'no lease came', abort=f'cmpl-{i}')\n"
        )
        env = {**os.environ, FAILURE_SOCKET_ENV: inbox.path}
        sender = subprocess.Popen([sys.executable, "-c", code], env=env)
        threading.Timer(2.0, go_on.set).start()  # the sender meanwhile fills the socket
        assert sender.wait(timeout=120) == 0
        inbox.drain()
        assert sorted(aborted, key=lambda r: int(r.split("-")[1])) == [f"cmpl-{i}" for i in range(60)]
    finally:
        go_on.set()
        inbox.close()
