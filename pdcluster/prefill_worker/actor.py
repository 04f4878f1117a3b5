"""PrefillWorker: a Ray actor hosting a vLLM engine that computes prompts and keeps their KV.

The router sends it each request with `max_tokens=1` and `kv_transfer_params.do_remote_decode`;
the PDConnector (producer half) keeps the blocks under a lease and returns the params a decode
worker needs to pull them. Everything else is the shared EngineActor.
"""

from __future__ import annotations

from pdcluster.engine.actor import EngineActor


class PrefillWorker(EngineActor):
    role = "prefill"
