"""orchestrator/placement.py: a role's placement as Ray actor options, and whether any live node
could host it (what `up` refuses, and what a replacement waits for), named as the user wrote it.
Nodes are rows as `ray.nodes()` gives them; tests/e2e/test_multinode.py places on real nodes."""

from __future__ import annotations

from pdcluster.config import Placement, Resources
from pdcluster.orchestrator.placement import (
    HEAD_RESOURCE,
    actor_options,
    demand,
    orchestrator_options,
    orchestrator_placement,
    unplaceable,
)


def node(address: str, labels: dict[str, str], alive: bool = True, **resources: float) -> dict:
    return {
        "NodeManagerAddress": address,
        "Alive": alive,
        "Labels": {"ray.io/node-id": address.replace(".", ""), **labels},
        "Resources": {"CPU": 1.0, **resources},
    }


HEAD = node("198.18.0.11", {}, **{HEAD_RESOURCE: 1.0})
PREFILL = node("198.18.0.12", {"pool": "prefill"})
DECODE = node("198.18.0.13", {"pool": "decode"}, CPU=2.0, decode_slots=1.0)


def test_a_placement_becomes_ray_actor_options():
    placement = Placement(labels={"pool": "decode"}, resources={"decode_slots": 1})
    options = actor_options(Resources(cpus=1, npus=1), placement)
    assert options == {
        "num_cpus": 1,
        "num_gpus": 0,
        "resources": {"NPU": 1, "decode_slots": 1},
        "label_selector": {"pool": "decode"},
    }
    assert actor_options(Resources(), Placement()) == {"num_cpus": 0, "num_gpus": 0}


def test_router_and_controller_go_to_the_head_unless_placed():
    assert orchestrator_options(None) == {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}
    assert unplaceable(*orchestrator_placement(None), [HEAD, PREFILL]) is None
    assert unplaceable(*orchestrator_placement(None), [PREFILL]) == "no live Ray node is the head node"
    placed = Placement(labels={"pool": "prefill"})
    assert orchestrator_options(placed)["label_selector"] == {"pool": "prefill"}
    assert unplaceable(*orchestrator_placement(placed), [HEAD, PREFILL]) is None


def test_a_role_no_live_node_can_host_is_named_with_what_is_missing():
    nodes = [HEAD, PREFILL, DECODE]
    decode = Placement(labels={"pool": "decode"})
    assert unplaceable(decode, demand(Resources(cpus=2), decode), nodes) is None
    assert unplaceable(decode, demand(Resources(cpus=3), decode), nodes) == (
        "no live Ray node with label pool=decode has resource CPU ≥ 3 (most: 2)"
    )
    gpu = unplaceable(Placement(), demand(Resources(cpus=1, gpus=1), Placement()), nodes)
    assert gpu == "no live Ray node has resource GPU ≥ 1 (most: 0)"
    missing = unplaceable(Placement(labels={"pool": "gpu"}), {}, nodes)
    assert missing.startswith("no live Ray node has label pool=gpu (nodes: 198.18.0.11: no labels; ")
    assert "198.18.0.13: pool=decode" in missing  # what the nodes do carry (not Ray's own labels)
    # The one decode node is lost: nothing can host decode until a node with the label joins.
    lost = [HEAD, PREFILL, {**DECODE, "Alive": False}]
    assert unplaceable(decode, {}, lost).startswith("no live Ray node has label pool=decode")


def test_every_resource_must_be_on_one_node():
    split = [node("198.18.0.12", {}, CPU=4.0), node("198.18.0.13", {}, CPU=1.0, decode_slots=1.0)]
    need = demand(Resources(cpus=2), Placement(resources={"decode_slots": 1}))
    assert unplaceable(Placement(), need, split) == "no live Ray node has CPU ≥ 2 and decode_slots ≥ 1 together"
