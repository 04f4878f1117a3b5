"""pdcluster: disaggregated prefill/decode LLM serving on Ray and vLLM.

A request enters the router (orchestrator/router/), is prefilled by a prefill worker (a vLLM
engine acting as KV producer), and its KV cache is pulled by a decode worker (a vLLM engine acting
as KV consumer) through our KV connector (kv_transfer/), which then streams the completion.
"""

__version__ = "0.1.0"
