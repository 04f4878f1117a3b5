"""Talking to one replica: the POST that sends it a phase of a request, and its failures sorted
by what they mean for a retry (handoff.py decides what to do)."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from pdcluster.orchestrator.policies import ReplicaLoad
from pdcluster.orchestrator.router.relay import error_outcome

logger = logging.getLogger(__name__)

# Nothing was sent: the replica cannot have started on the request (nor consumed a KV lease).
NEVER_REACHED_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# The replica was reached, then the connection failed before its answer (or during it, for a
# whole-body answer): it may have started on the request, and a decode replica may have pulled
# (and so used up) the KV lease it was sent.
REACHED_THEN_FAILED_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class PhaseFailed(Exception):
    """A replica failed a phase of a request before any of its answer was relayed."""

    what = "failed"

    def __init__(self, replica: ReplicaLoad, cause: httpx.HTTPError):
        super().__init__(f"{replica.role} replica {replica.replica_id} {self.what}: {type(cause).__name__}: {cause}")
        self.replica = replica
        self.cause = cause


class NeverReached(PhaseFailed):
    what = "unreachable"


class ReachedThenFailed(PhaseFailed):
    what = "failed before answering"


class Refused(PhaseFailed):
    """The replica answered 503: it started nothing of the request (an engine host whose engine
    died, engine/dead_engine.py; vLLM while it scales), so it is retried as one never reached."""

    what = "refused the request"


async def post(
    http: httpx.AsyncClient,
    replica: ReplicaLoad,
    path: str,
    body: dict[str, Any],
    stream: bool,
    request_id: str,
) -> httpx.Response:
    """POST to one replica: its response (for `stream`, once the headers are in). Connection
    failures raise NeverReached or ReachedThenFailed, a 503 answer Refused; timeouts and other
    HTTP errors pass."""
    headers = {"X-Request-Id": request_id}
    try:
        if stream:
            request = http.build_request("POST", replica.url + path, json=body, headers=headers)
            response = await http.send(request, stream=True)
        else:
            response = await http.post(replica.url + path, json=body, headers=headers)
        if response.status_code != 503:
            return response
        await response.aread()
        await response.aclose()
        message = f"503: {response.text[:300]}"
        failure: PhaseFailed = Refused(
            replica, httpx.HTTPStatusError(message, request=response.request, response=response)
        )
    except NEVER_REACHED_ERRORS as exc:
        failure = NeverReached(replica, exc)
    except REACHED_THEN_FAILED_ERRORS as exc:
        failure = ReachedThenFailed(replica, exc)
    logger.warning("%s", failure)
    raise failure from failure.cause


def outcome_for(status: int, content: bytes = b"") -> str:
    """The `pdcluster_requests_total` outcome of a replica's HTTP answer (its JSON body tells a
    failed KV pull, which the decode engine names itself, from other errors)."""
    if status == 200:
        return "ok"
    if status < 500:
        return "client_error"
    try:
        error = json.loads(content).get("error") if content else None
    except (ValueError, AttributeError):
        error = None
    return error_outcome(error)
