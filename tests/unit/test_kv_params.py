"""`KVParams`: the typed kv_transfer_params every side reads (producer, router, consumer)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdcluster.keys import KV_PARAMS, derive_key
from pdcluster.kv_transfer import params as kvp
from pdcluster.kv_transfer.params import KVParams

LEASE = KVParams(
    remote_engine_id="c-prefill-0",
    remote_request_id="cmpl-1-0",
    remote_endpoints=("198.18.0.1:47000",),
    remote_block_ids=(4, 9, 2),
    remote_num_tokens=300,
    remote_lease_expiry=1764567890.5,
)


def test_round_trip_and_flags():
    params = LEASE.to_dict()
    assert KVParams.from_dict(params) == LEASE
    assert kvp.wants_remote_prefill(params) and not kvp.wants_remote_decode(params)
    assert kvp.wants_remote_decode(kvp.ASK_PREFILL) and not kvp.wants_remote_prefill(kvp.ASK_PREFILL)
    # Only what belongs to this request travels: nothing static per producer engine.
    assert set(params) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_request_id",
        "remote_endpoints",
        "remote_block_ids",
        "remote_num_tokens",
        "remote_lease_expiry",
        "remote_lease_seconds",
        "remote_signature",
    }


KEY = derive_key("params-test-secret", KV_PARAMS)


def test_signed_params_verify_after_the_json_round_trip_the_router_makes():
    signed = LEASE.signed(KEY)
    assert not LEASE.verify(KEY)  # unsigned
    through_router = KVParams.from_dict(json.loads(json.dumps(signed.to_dict())))
    assert through_router.verify(KEY)
    assert not through_router.verify(derive_key("another-cluster", KV_PARAMS))


@pytest.mark.parametrize(
    "change",
    [
        {"remote_engine_id": "c-prefill-1"},
        {"remote_request_id": "cmpl-2-0"},
        {"remote_endpoints": ["198.18.0.66:47000"]},
        {"remote_block_ids": [4, 9, 3]},
        {"remote_num_tokens": 301},
        {"remote_lease_expiry": 1764567890.75},
        {"remote_lease_seconds": 60.0},
        {"remote_signature": "00" * 32},
    ],
)
@pytest.mark.parametrize("lease_seconds", [0.0, 30.0])
def test_any_altered_field_breaks_the_signature(change, lease_seconds):
    signed = replace(LEASE, remote_lease_seconds=lease_seconds).signed(KEY)
    assert KVParams.from_dict(signed.to_dict()).verify(KEY)
    assert not KVParams.from_dict({**signed.to_dict(), **change}).verify(KEY)


def test_params_that_do_not_say_how_long_leases_last_still_verify_and_read_as_the_consumers_setting():
    """A producer from before `remote_lease_seconds` signed params without it: they verify as
    they did, and the consumer takes its own lease_seconds for theirs."""
    old = LEASE.signed(KEY).to_dict()
    del old["remote_lease_seconds"]
    read = KVParams.from_dict(old)
    assert read.verify(KEY) and read.lease_seconds_or(30.0) == 30.0
    assert replace(LEASE, remote_lease_seconds=10.0).lease_seconds_or(30.0) == 10.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_block_ids": None}, "malformed"),
        ({"remote_endpoints": []}, "remote_endpoints must be a non-empty list"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids must be a list"),
        ({"remote_block_ids": [1, "2"]}, "not an integer"),
        ({"remote_block_ids": [1, True]}, "not an integer"),
        ({"remote_block_ids": [-1]}, "negative"),
        ({"remote_num_tokens": 3.5}, "not an integer"),
        ({"remote_lease_expiry": "soon"}, "malformed"),
        ({"remote_lease_seconds": -1}, "remote_lease_seconds must be 0"),
        ({"remote_lease_seconds": 1e-6}, "remote_lease_seconds must be 0"),  # renewals every step
        ({"remote_lease_seconds": float("nan")}, "remote_lease_seconds must be 0"),
        ({"remote_lease_seconds": float("inf")}, "remote_lease_seconds must be 0"),
        ({"remote_lease_seconds": "long"}, "malformed"),
    ],
)
def test_malformed_params_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        KVParams.from_dict({**LEASE.to_dict(), **change})


def test_missing_key_is_named():
    params = LEASE.to_dict()
    del params["remote_request_id"]
    with pytest.raises(ValueError, match="lacks 'remote_request_id'"):
        KVParams.from_dict(params)
    with pytest.raises(ValueError, match="must be an object"):
        KVParams.from_dict(["not", "a", "dict"])


def test_await_params_round_trip_and_name_what_is_wrong():
    voucher = KVParams("p", "r", ("127.0.0.1:1",), (1,), 10, 1e10)
    spec = kvp.AwaitParams("0123456789abcdef" * 2, voucher, 123.5)
    params = json.loads(json.dumps(spec.to_dict()))
    assert kvp.wants_lease_await(params) and not kvp.wants_remote_prefill(params)
    assert kvp.AwaitParams.from_dict(params) == spec
    for bad, message in [
        ({"key": "xyz", "voucher": voucher.to_dict(), "deadline": 1}, "hex digits"),
        ({"key": "a" * 32, "voucher": voucher.to_dict()}, "deadline"),
        ({"key": "a" * 32, "deadline": 1}, "must be an object"),
    ]:
        with pytest.raises(ValueError, match=message):
            kvp.AwaitParams.from_dict({kvp.AWAIT: bad})
    assert kvp.lease_key({**kvp.ASK_PREFILL, kvp.LEASE_KEY: "a" * 32}) == "a" * 32
    assert kvp.lease_key({**kvp.ASK_PREFILL, kvp.LEASE_KEY: "not hex"}) == ""
    assert kvp.lease_key(kvp.ASK_PREFILL) == ""
