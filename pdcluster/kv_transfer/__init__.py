"""KV handoff from prefill to decode engines.

connector.py   vLLM KV connector facade (PDConnector), loaded via kv_connector_module_path
scheduler.py   its scheduler half: leases on P, pull planning on D
worker.py      its worker half: transport server on P, pulls on D
leases.py      P-side lease table (LEASED -> TRANSFERRING -> RELEASED)
staging.py     event-synced non-blocking device<->host staging
kv_cache.py    the paged cache as transfers see it; chunk planning
protocol.py    protocol version, KV layout, compatibility checks
params.py      KVParams: the typed kv_transfer_params (vLLM-free: the router reads them too)
settings.py    KVTransferSettings: the one settings model (YAML section, connector config)
faults.py      fault injection dice (kv_transfer.fault_injection)
failures.py    why a pull failed, from the worker half to the engine's HTTP answer
metadata.py    what the scheduler half tells the worker half each step
producer.py    what a KV server serves: leased blocks, handshake
stats.py       transfer counters through vLLM's stats pipeline
wire.py        copy-free KVChunk encoding
transports/    the transport interface and its backends (grpc, shm, collective)
"""
