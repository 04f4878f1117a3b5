"""Keys of `kv_transfer_params`, the dict that travels between prefill, router and decode.

Free of vLLM imports so that the router (which never loads vLLM) can read the params too.
"""

# The first group follows vLLM's NIXL conventions so existing proxies understand them; the rest
# are ours.
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
REMOTE_ENDPOINTS = "remote_endpoints"  # one "host:port" per tensor-parallel rank
REMOTE_LEASE_EXPIRY = "remote_lease_expiry"  # unix time after which P frees the blocks
TRANSPORT = "transport"  # the producer's configured kv_transfer.backend
KV_BACKENDS = "kv_backends"  # the backends the producer's KV server offers
KV_NODE = "kv_node"  # the producer's node identity (transports/selection.py)
KV_DEVICE = "kv_device"  # the producer's KV cache device kind: cpu | cuda | npu
PROTOCOL = "kv_protocol_version"
# Internal markers (never sent by clients).
_PULL_PLANNED = "_pdcluster_pull_planned"
_P_TRUNCATED = "_pdcluster_prefill_truncated"
