"""Security against a running CPU cluster (2 prefill + 2 decode, shared with test_reliability.py
and test_routing.py): a raw gRPC client gets nothing from a KV server, internal ports bind where
configured, every replica port takes only the engine key, no secret in status or logs."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from pdcluster.keys import ENGINE_HTTP, KV_AUTH, KV_PARAMS, derive_key, engine_http_token
from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION
from pdcluster.protos import kv_transfer_pb2 as pb
from tests.e2e.pd.conftest import PD_SECRET
from tests.support.cluster import cli
from tests.support.engines import assert_engine_key_required
from tests.support.raw_grpc import refused_raw_pull

pytestmark = pytest.mark.e2e

NAME = "tiny"
SECRET = PD_SECRET
ENGINE_HEADERS = {"Authorization": f"Bearer {engine_http_token(SECRET)}"}  # what the router sends engines


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    """2 prefill + 2 decode (tests/e2e/conftest.py)."""
    return pd_cluster


def _prefill_params(cluster) -> dict:
    prefill_url = next(
        r["url"] for r in cluster.status()["replicas"] if r["role"] == "prefill" and r["state"] == "ready"
    )
    body = {
        "model": NAME,
        "prompt": "secret prompt content",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    response = httpx.post(prefill_url + "/v1/completions", json=body, headers=ENGINE_HEADERS, timeout=60)
    return response.json()["kv_transfer_params"]


def test_kv_endpoint_refuses_raw_client_without_secret(cluster):
    params = _prefill_params(cluster)
    (endpoint,) = params["remote_endpoints"]
    assert endpoint.startswith("127.0.0.1:")
    request = pb.PullRequest(
        protocol_version=PROTOCOL_VERSION,
        request_id=params["remote_request_id"],
        block_ids=params["remote_block_ids"],
    )
    assert refused_raw_pull(endpoint, request, 10) == grpc.StatusCode.UNAUTHENTICATED


def _listening(port: int) -> set[str]:
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue  # a kernel booted with IPv6 off has no tcp6 table
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                addresses.add(address)
    return addresses


def test_internal_ports_bind_to_the_configured_address(cluster):
    # 127.0.0.1 as /proc/net/tcp writes it, and as tcp6 writes it for a v4-mapped dual-stack
    # socket (gRPC binds that way); a wildcard bind would show up as 00000000 or ::.
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    status = cluster.status()
    ports = [int(r["url"].rsplit(":", 1)[1]) for r in status["replicas"] if r["url"]]
    ports.append(int(cluster.endpoint.rsplit(":", 1)[1]))
    ports.append(int(_prefill_params(cluster)["remote_endpoints"][0].rsplit(":", 1)[1]))
    for port in ports:
        addresses = _listening(port)
        assert addresses and addresses <= loopback, (port, addresses)


def test_every_replica_port_requires_the_engine_key(cluster):
    replicas = [r for r in cluster.status()["replicas"] if r["state"] == "ready"]
    assert {r["role"] for r in replicas} == {"prefill", "decode"}
    for replica in replicas:
        assert_engine_key_required(replica["url"], ENGINE_HEADERS)


def test_no_secret_in_status_or_logs(cluster):
    keys = [derive_key(SECRET, purpose) for purpose in (KV_AUTH, KV_PARAMS, ENGINE_HTTP)]
    forbidden = [SECRET, *(key.hex() for key in keys)]
    for leaked in forbidden:
        assert leaked not in cli(cluster.home, "status", "--json", "--name", cluster.name).stdout
        assert leaked not in cli(cluster.home, "status", "--name", cluster.name).stdout
    from ray._common.utils import get_default_ray_temp_dir  # where `up`'s Ray head keeps its session

    ray_logs = list((Path(get_default_ray_temp_dir()) / "session_latest" / "logs").glob("*"))
    assert [p for p in ray_logs if p.name.startswith("worker-")], "no Ray worker log found to read"
    logs = ray_logs + list((cluster.home / "logs").glob("*"))
    for path in logs:
        if path.is_file():
            content = path.read_bytes()
            for leaked in forbidden:
                assert leaked.encode() not in content, path
