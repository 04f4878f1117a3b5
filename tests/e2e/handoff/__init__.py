"""The P -> D handoff through PDConnector with real vLLM engines in separate processes, driven over
HTTP as the router drives them (prefill: max_tokens=1, do_remote_decode; decode: the returned
params). Float32, strict identity of tokens and logprobs (tests/support/identity.py; bf16 in
test_bf16_identity.py). Engines: the aggregated reference (tests/e2e/conftest.py), one prefill (backend
auto: offers grpc, shm, mooncake, collective) and decodes: grpc (the full matrix), auto (shm on
one node; vLLM's own worker-process layout, the others single-process), collective (gloo),
mooncake (TCP; one request at a time, so a second queues: lease renewal), one whose every pull
fails (recompute policy) and one whose layout does not match (block size 64; fail policy).
Started once for the package's modules (conftest.py; the engines' specs in common.py).
"""
