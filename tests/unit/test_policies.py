"""Routing policies pick only READY replicas of the asked role, by load or in turn."""

import pytest

from pdcluster.errors import NoReplicaError
from pdcluster.orchestrator.policies import LeastLoaded, ReplicaLoad, RoundRobin, make_policy
from pdcluster.orchestrator.replicas import ReplicaState


def replicas():
    return [
        ReplicaLoad("prefill-0", "prefill", "u0"),
        ReplicaLoad("prefill-1", "prefill", "u1"),
        ReplicaLoad("decode-0", "decode", "u2"),
        ReplicaLoad("decode-1", "decode", "u3"),
        ReplicaLoad("decode-2", "decode", "u4", state=ReplicaState.DRAINING),
        ReplicaLoad("decode-3", "decode", "u5", state=ReplicaState.STARTING),
    ]


def test_only_ready_replicas_of_the_role_are_chosen():
    pool = replicas()
    for policy in (LeastLoaded(), RoundRobin()):
        chosen = {policy.choose(pool, "decode").replica_id for _ in range(20)}
        assert chosen == {"decode-0", "decode-1"}
        assert {policy.choose(pool, "prefill").replica_id for _ in range(20)} == {"prefill-0", "prefill-1"}


def test_least_loaded_uses_prompt_tokens_for_prefill_and_sequences_for_decode():
    pool = replicas()
    pool[0].inflight_prompt_tokens, pool[0].inflight_requests = 5000, 1
    pool[1].inflight_prompt_tokens, pool[1].inflight_requests = 100, 3
    pool[2].inflight_requests, pool[3].inflight_requests = 4, 2
    policy = LeastLoaded()
    assert policy.choose(pool, "prefill").replica_id == "prefill-1"
    assert policy.choose(pool, "decode").replica_id == "decode-1"


def test_round_robin_alternates():
    pool = replicas()
    policy = RoundRobin()
    picks = [policy.choose(pool, "decode").replica_id for _ in range(4)]
    assert picks[0] != picks[1] and picks[:2] == picks[2:]


def test_excluded_and_missing_roles_raise_no_replica():
    pool = replicas()
    with pytest.raises(NoReplicaError, match="no ready aggregated replica"):
        LeastLoaded().choose(pool, "aggregated")
    with pytest.raises(NoReplicaError):
        LeastLoaded().choose(pool, "prefill", exclude={"prefill-0", "prefill-1"})


def test_unknown_policy():
    with pytest.raises(ValueError, match="least_loaded"):
        make_policy("random")
