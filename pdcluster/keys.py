"""Keys derived from the cluster secret, one per purpose.

The secret itself is used for nothing but derivation (HMAC-SHA256 keyed by the secret over a
purpose label), so each component holds only the key it needs: the router holds the engine HTTP
key and never the KV secret; a leak of one purpose's key gives nothing of the others'. Free of
vLLM and gRPC imports: the router, the engines and the KV connector all derive through here.
"""

from __future__ import annotations

import hashlib
import hmac

ENGINE_HTTP = "engine-http"  # bearer the router presents to every engine's HTTP app
KV_PARAMS = "kv-params"  # signs the kv_transfer_params a producer hands out
KV_AUTH = "kv-auth"  # challenge-response of the KV control channel


def derive_key(secret: str, purpose: str) -> bytes:
    if not secret:
        raise ValueError("cannot derive keys from an empty cluster secret")
    return hmac.new(secret.encode(), f"pdcluster/{purpose}/v1".encode(), hashlib.sha256).digest()


def engine_http_token(secret: str) -> str:
    """The bearer token of engines' HTTP apps (hex: it travels in an Authorization header)."""
    return derive_key(secret, ENGINE_HTTP).hex()


def mac(key: bytes, label: str, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 over a label and length-prefixed parts (no two part lists encode the same)."""
    h = hmac.new(key, label.encode(), hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.digest()
