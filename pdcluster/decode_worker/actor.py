"""DecodeWorker: a Ray actor hosting a vLLM engine that pulls prefilled KV and streams tokens.

The router sends it each request with the `kv_transfer_params` its prefill returned; the
PDConnector (consumer half) pulls the blocks before the request decodes. Async scheduling is
requested by default (EngineSpec.async_scheduling); `info()` reports whether vLLM kept it on.
"""

from __future__ import annotations

from pdcluster.engine.actor import EngineActor


class DecodeWorker(EngineActor):
    role = "decode"
