"""KV handoff from prefill to decode engines.

connector.py   vLLM KV connector facade (PDConnector), loaded via kv_connector_module_path
scheduler.py   its scheduler half: leases on P, pull planning on D
worker.py      its worker half: transport server on P, pulls on D
leases.py      P-side lease table (LEASED -> TRANSFERRING -> RELEASED)
staging.py     event-synced non-blocking device<->host staging
kv_cache.py    the paged cache as transfers see it; chunk planning
protocol.py    protocol version, KV layout, compatibility checks
params.py      keys of kv_transfer_params (vLLM-free: the router reads them too)
wire.py        copy-free KVChunk encoding
transports/    the transport interface and its backends (grpc)
"""
