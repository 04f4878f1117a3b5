"""Error hierarchy shared by every pdcluster component.

Layers raise the most specific class; callers at a boundary (router, CLI, connector worker) turn
them into what their client understands: an OpenAI-style JSON error with `http_status`, a
one-line CLI message with exit code 2, or a failed KV load handled by the configured policy.
"""

from __future__ import annotations


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
