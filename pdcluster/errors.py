"""Error hierarchy shared by every pdcluster component.

Layers raise the most specific class; callers at a boundary (router, CLI, connector worker) turn
them into what their client understands: an OpenAI-style JSON error with `http_status`, a
one-line CLI message with exit code 2, or a failed KV load handled by the configured policy.
`format_errors` words a pydantic validation error as ConfigError lines naming each key's YAML
path (the cluster YAML, config.py; the connector's settings, kv_transfer/settings.py).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


def openai_error(message: str, kind: str, code: str | int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body: what the router and the engine ports answer a request they
    refuse or fail."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class PDClusterError(Exception):
    """Base class. `http_status` and `error_type` shape the router's OpenAI-style error body."""

    http_status = 500
    error_type = "internal_error"


class ConfigError(PDClusterError):
    """The cluster YAML (or a CLI flag mirroring it) is invalid. Message names the YAML path."""

    http_status = 400
    error_type = "invalid_request_error"


class KVTransferError(PDClusterError):
    """A KV handoff failed; the request is recomputed or failed per `kv_load_failure_policy`."""

    http_status = 502
    error_type = "kv_transfer_error"


class PortTakenError(KVTransferError):
    """The KV server could not bind its port (another process holds it): another port may do."""


class HandshakeError(KVTransferError):
    """Producer and consumer are incompatible (protocol, model, dtype, block size, layers)."""


class AuthenticationError(KVTransferError):
    """The peer did not prove it holds the cluster secret (or its session is unknown)."""

    http_status = 401
    error_type = "authentication_error"


class UntrustedParamsError(KVTransferError):
    """kv_transfer_params that no producer of this cluster signed (forged, altered or stale
    keys): the consumer dials nothing for them."""


class LeaseNotFoundError(KVTransferError):
    """The producer holds no lease for the requested blocks (expired, released or unknown)."""


class LeaseExpiredError(LeaseNotFoundError):
    """The lease ended (expired or released) before this pull: the producer's blocks are gone."""


class TransferTimeoutError(KVTransferError):
    """A pull did not complete within its deadline."""

    http_status = 504


class InjectedFaultError(KVTransferError):
    """A failure injected on purpose by the `fault_injection` settings (tests, drills)."""


class NoReplicaError(PDClusterError):
    """No ready replica of a role can take the request."""

    http_status = 503
    error_type = "service_unavailable"


class ReplicaError(PDClusterError):
    """A replica failed while serving a request (engine died, connection dropped)."""

    http_status = 502
    error_type = "upstream_error"


_KEY_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*: ")


def _format_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind == "extra_forbidden":
        message = "unknown key"
    elif kind == "missing":
        message = "required"
    elif kind == "greater_than_equal":
        message = f"must be ≥ {ctx['ge']}"
    elif kind == "greater_than":
        message = f"must be > {ctx['gt']}"
    elif kind == "less_than_equal":
        message = f"must be ≤ {ctx['le']}"
    elif kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
        # A model-level rule names the key it is about ("port_range: ..."): extend the path.
        if _KEY_PREFIX.match(message):
            return f"{loc}.{message}" if loc else message
    else:
        message = err["msg"].rstrip(".")
        secret = any("secret" in str(part) or "api_keys" in str(part) for part in err["loc"])
        if "input" in err and kind not in ("literal_error",) and not secret:  # never echo a credential
            message += f" (got {err['input']!r})"
    return f"{loc}: {message}" if loc else message


def format_errors(exc: ValidationError) -> list[str]:
    """A pydantic error as lines naming the YAML path of each offending key."""
    return [_format_error(e) for e in exc.errors(include_url=False)]


def root_cause(exc: BaseException) -> BaseException:
    """What a Ray task raised at the bottom of a chain of remote calls (the CLI's call to the
    controller, the controller's to an actor): Ray wraps each hop in a RayTaskError whose first
    line names the task (and colours it), not the problem."""
    ray = sys.modules.get("ray")
    while ray is not None and isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def one_line(exc: BaseException, limit: int = 500) -> str:
    """`exc`'s root cause as one line: its class and its whole message, lines joined (a
    validation error's first line says only how many errors follow)."""
    cause = root_cause(exc)
    return f"{type(cause).__name__}: {' '.join(str(cause).split())}"[:limit]
