"""The router: one OpenAI-compatible HTTP endpoint in front of the replica pools.

A request is read and validated (requests.py), then run through its phases (handoff.py): in
disaggregated mode a decode replica is chosen, a prefill replica computes the prompt's KV and
its first token, and the decode replica pulls that KV and generates the rest, its answer relayed
to the client (relay.py; with the first token streamed at once, continuation.py); in aggregated
mode one replica does both. Replicas come from the controller (`update_replicas`) and are chosen
by the routing policy among the READY ones (pool.py); app.py holds the routes, the API-key guard,
the server's lifecycle and the Ray actor.
"""

from pdcluster.orchestrator.router.app import Router, RouterActor
from pdcluster.orchestrator.router.relay import SSEEvents
from pdcluster.orchestrator.router.requests import (
    INLINE_TOKENIZE_CHARS,
    BadRequest,
    error_response,
)
from pdcluster.orchestrator.router.settings import ENDPOINTS, RouterSettings

__all__ = [
    "ENDPOINTS",
    "INLINE_TOKENIZE_CHARS",
    "BadRequest",
    "Router",
    "RouterActor",
    "RouterSettings",
    "SSEEvents",
    "error_response",
]
