"""The committed gRPC stubs are what `make protos` generates from the .proto files."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gen_protos  # noqa: E402


def test_generated_stubs_are_current(tmp_path):
    for generated in gen_protos.generate(tmp_path):
        committed = ROOT / "pdcluster" / "protos" / generated.name
        assert committed.exists(), f"{committed.name} missing: run `make protos`"
        assert committed.read_text() == generated.read_text(), f"{committed.name} stale: run `make protos`"


def test_protocol_version_is_in_the_package_name():
    from pdcluster.kv_transfer.protocol import PROTOCOL_VERSION
    from pdcluster.kv_transfer.transports.grpc_transport import SERVICE

    assert SERVICE == f"pdcluster.kv.v{PROTOCOL_VERSION}.KVTransfer"
