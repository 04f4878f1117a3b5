"""What the controller tells the router (from the cluster YAML's `router` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The OpenAI endpoints the router serves, by request kind.
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RouterSettings:
    model_name: str
    mode: str = "disaggregated"
    policy: str = "cache_aware"
    api_keys: list[str] = field(default_factory=list)
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 << 20
    max_model_len: int | None = None
    tokenizer_path: str | None = None
    phase_attempts: int = 3  # replicas tried per role for one request (handoff.py)
    first_token_from_prefill: bool = True  # router.first_token_from_prefill (continuation.py)
    decode_ahead: bool = True  # router.decode_ahead (handoff.py): decode sent with the prefill
    migration_limit: int = 2  # router.migration_limit: moves of one stream to another decode replica
    local_prefill_max_tokens: int = 0  # router.local_prefill_max_tokens (conditional disaggregation)
    local_prefill_queue_tokens: int = 0  # router.local_prefill_queue_tokens (the same, by prefill load)
    slo_window_s: float = 30.0  # autoscale.window_seconds: the p90s the SLO planner reads
    # The model's generation_config.json as request defaults (continuation.request_defaults):
    # what the engines apply to fields a client leaves out, so the router decides as they run.
    generation_defaults: dict = field(default_factory=dict)
    abandon_after_prefill_rate: float = 0.0  # fault injection (router.fault_injection)
    # The key engines' HTTP apps require (keys.engine_http_token): the router presents it on every
    # call to a replica. Never shown (repr) or logged; the router never holds the KV secret itself.
    engine_token: str = field(default="", repr=False)

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"
