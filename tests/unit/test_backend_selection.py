"""Which KV backend a P/D pair uses: config values, the consumer's choice, what status shows."""

from __future__ import annotations

import pytest

from pdcluster.errors import KVTransferError, TransferTimeoutError
from pdcluster.kv_transfer.settings import KVTransferSettings
from pdcluster.kv_transfer.stats import PDTransferStats, failure_cause
from pdcluster.kv_transfer.transports.selection import choose_backend, node_id, offered_backends
from pdcluster.orchestrator.metrics import RouterMetrics
from pdcluster.orchestrator.status import format_status

ALL = ("grpc", "shm", "collective")
WITH_MOONCAKE = (*ALL, "mooncake")


def choose(configured, *, same_node, local="cpu", remote="cpu", offers=ALL, encrypted=False, local_offers=ALL):
    return choose_backend(
        configured,
        local_node="node-a",
        local_device=local,
        remote_node="node-a" if same_node else "node-b",
        remote_device=remote,
        remote_offers=offers,
        remote_engine="p0",
        encrypted=encrypted,
        local_offers=local_offers,
    )


@pytest.mark.parametrize(
    ("same_node", "local", "remote", "offers", "expected"),
    [
        (True, "cpu", "cpu", ALL, "shm"),
        (False, "cpu", "cpu", ALL, "grpc"),  # gloo over TCP is no faster than gRPC here
        (False, "cuda", "cuda", ALL, "collective"),
        (False, "npu", "npu", ALL, "collective"),
        (False, "cuda", "npu", ALL, "grpc"),
        (True, "cuda", "cuda", ALL, "shm"),
        (True, "cpu", "cpu", ("grpc",), "grpc"),  # the producer forced grpc
    ],
)
def test_auto_picks_by_node_and_device(same_node, local, remote, offers, expected):
    assert choose("auto", same_node=same_node, local=local, remote=remote, offers=offers) == expected


@pytest.mark.parametrize(
    ("same_node", "offers", "local_offers", "encrypted", "device", "expected"),
    [
        (False, WITH_MOONCAKE, WITH_MOONCAKE, False, "cpu", "mooncake"),  # across nodes, both have it
        (False, WITH_MOONCAKE, WITH_MOONCAKE, False, "cuda", "mooncake"),  # device caches: staged
        (True, WITH_MOONCAKE, WITH_MOONCAKE, False, "cpu", "shm"),  # one node: shm is faster
        (False, ALL, WITH_MOONCAKE, False, "cpu", "grpc"),  # the producer lacks it
        (False, WITH_MOONCAKE, ALL, False, "cpu", "grpc"),  # this consumer lacks it
        (False, WITH_MOONCAKE, ALL, False, "npu", "collective"),  # ... with NPU caches: HCCL
        (False, WITH_MOONCAKE, WITH_MOONCAKE, True, "cpu", "grpc"),  # TLS: Mooncake carries KV in clear
    ],
)
def test_auto_picks_mooncake_across_nodes_when_both_have_it(
    same_node, offers, local_offers, encrypted, device, expected
):
    chosen = choose(
        "auto",
        same_node=same_node,
        local=device,
        remote=device,
        offers=offers,
        local_offers=local_offers,
        encrypted=encrypted,
    )
    assert chosen == expected


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_auto_with_tls_never_moves_kv_in_clear_across_nodes(device):
    """NCCL/HCCL carry KV unencrypted: with kv_transfer.tls, auto keeps to grpc (which runs TLS)."""
    assert choose("auto", same_node=False, local=device, remote=device, encrypted=True) == "grpc"
    assert choose("auto", same_node=True, local=device, remote=device, encrypted=True) == "shm"


@pytest.mark.parametrize("backend", ALL)
def test_a_forced_backend_is_used_when_offered(backend):
    assert choose(backend, same_node=True) == backend


def test_forced_backend_not_offered_names_both_sides():
    with pytest.raises(KVTransferError, match=r"offers KV backends \['grpc'\], this consumer is configured for 'shm'"):
        choose("shm", same_node=True, offers=("grpc",))


def test_forced_shm_across_nodes_names_both_nodes():
    with pytest.raises(KVTransferError, match="producer p0 is on node-b, this consumer on node-a"):
        choose("shm", same_node=False)


def test_forced_collective_across_device_kinds_is_refused():
    with pytest.raises(KVTransferError, match="producer p0 has npu, this consumer cuda"):
        choose("collective", same_node=False, local="cuda", remote="npu")


def test_producer_offers():
    # Mooncake's transfer engine is installed (the lock file) and reads any cache (device caches
    # through host slots); its ports listen on every interface, so a KV server bound to loopback
    # does not offer it.
    assert offered_backends("auto", "0.0.0.0") == ["grpc", "shm", "collective", "mooncake"]
    assert offered_backends("auto", "127.0.0.1") == ["grpc", "shm", "collective"]
    assert offered_backends("mooncake", "127.0.0.1") == ["mooncake"]  # asked for
    assert offered_backends("shm") == ["shm"]
    with pytest.raises(KVTransferError, match="choose one of"):
        offered_backends("pigeon")


def test_node_id_is_stable_and_names_the_host():
    import socket

    assert node_id() == node_id()
    assert node_id().startswith(socket.gethostname() + "/")


def test_config_backend_values():
    assert KVTransferSettings().backend == "auto"
    for value in ("auto", "grpc", "shm", "collective", "mooncake"):
        assert KVTransferSettings(backend=value).backend == value
    with pytest.raises(ValueError):
        KVTransferSettings(backend="rdma")


def test_stats_merge_backends_per_producer():
    a, b = PDTransferStats(), PDTransferStats()
    a.set_backend("p0", "shm")
    b.set_backend("p1", "grpc")
    merged = a.aggregate(b)
    assert merged.data["backends"] == {"p0": "shm", "p1": "grpc"}
    assert "backends" not in merged.reduce()
    assert not a.is_empty()


def test_failed_pulls_are_counted_by_cause_across_workers():
    a, b = PDTransferStats(), PDTransferStats()
    a.add_failure(failure_cause(TransferTimeoutError("late")))
    b.add_failure(failure_cause(TransferTimeoutError("late")))
    b.add_failure(failure_cause(ConnectionResetError("reset")))
    b.add_failure(failure_cause(KVTransferError("no")))
    assert a.aggregate(b).data["pull_failures"] == {"transfer_timeout": 2, "os_error": 1, "kv_transfer": 1}
    row = {"replica_id": "decode-0", "role": "decode", "stats": {"kv_pull_failures": {"transfer_timeout": 2}}}
    text = RouterMetrics(lambda: [row]).exposition().decode()
    assert 'pdcluster_kv_pull_failures_total{cause="transfer_timeout",replica="decode-0"} 2.0' in text


def test_status_table_shows_backend_per_pair():
    row = {
        "replica": "decode-0",
        "role": "decode",
        "node": "n1",
        "state": "ready",
        "stage": "",
        "error": "",
        "inflight": 0,
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
        "ttft_p50": None,
        "ttft_p99": None,
        "itl_p50": None,
        "itl_p99": None,
        "prefill_p50": None,
        "prefill_p99": None,
        "async_scheduling": True,
        "async_scheduling_reason": "",
        "kv_backend": "auto",
        "kv_backends": {"c-prefill-0": "shm", "c-prefill-1": "grpc"},
        "stats": {},
        "single_process": False,
        "single_process_reason": "no explicit core list (cpu_bind) to bind the engine thread to",
    }
    status = {"name": "c", "mode": "pd", "model": "m", "endpoint": "e", "replicas": [row]}
    table = format_status(status)
    assert "kv auto: c-prefill-0→shm, c-prefill-1→grpc" in table
    assert "worker process kept (no explicit core list (cpu_bind) to bind the engine thread to)" in table
