"""The handoff package's engines (their specs, started by conftest.py) and what its modules share."""

from __future__ import annotations

import httpx

from tests.support.cores import FIRST, SECOND
from tests.support.engines import tiny_engine
from tests.support.handoff import greedy
from tests.support.identity import Greedy, assert_same_greedy

BLOCK = 128  # vLLM's CPU default block size
LEASE_S = 10
DTYPE = "float32"


def spec(
    engine_id,
    role,
    bind,
    secret_file,
    *,
    policy="recompute",
    kv=None,
    single_process=True,
    scope="engine",
    **engine_args,
):
    return tiny_engine(
        engine_id,
        role,
        dtype=DTYPE,
        secret_file=secret_file,
        kv={"failure_policy": policy, **(kv or {})},
        engine_args={"max_num_seqs": 16, **engine_args},
        cpu_threads_bind=bind,
        single_process=single_process,
        cpu_bind_scope=scope,
    )


def engine_specs(secret):
    """The prefill and the decodes every module of the package hands off between."""
    return [
        # Bound beyond loopback, so auto also offers mooncake (Mooncake listens on every interface).
        spec(
            "prefill",
            "prefill",
            FIRST,
            secret,
            kv={"lease_seconds": LEASE_S, "backend": "auto", "bind_host": "0.0.0.0", "advertise_host": "127.0.0.1"},
        ),
        # binds its engine thread to decode's core (as the others do), the rest of it runs on any
        # core: the clusters lane's decodes take that core whole (configs/local-cpu.yaml), and a decode
        # confined to it with them pulled its batch too late for its leases
        spec("decode", "decode", SECOND, secret),
        # vLLM's own CPU layout (a worker process holds the model); the others run single-process
        spec("decode-shm", "decode", SECOND, secret, kv={"backend": "auto"}, single_process=False),
        spec("decode-collective", "decode", SECOND, secret, kv={"backend": "collective"}),
        # one request at a time: a second one queues (lease renewal)
        spec("decode-mooncake", "decode", SECOND, secret, kv={"backend": "mooncake"}, max_num_seqs=1),
        # every thread of it on decode's core (cpu_bind_scope replica: test_threads_and_sockets)
        spec(
            "decode-faulty",
            "decode",
            SECOND,
            secret,
            kv={"fault_injection": {"pull_failure_rate": 1.0}},
            scope="replica",
        ),
        spec("decode-mismatch", "decode", SECOND, secret, policy="fail", block_size=64),
    ]


def assert_same(expected: Greedy, response: httpx.Response, what: str = "") -> None:
    assert_same_greedy(expected, greedy(response), DTYPE, what)
