"""Where replicas, the router and the controller may run on a Ray cluster of several nodes.

A role's `placement` (config.Placement) becomes Ray actor options: `label_selector` for the node
labels, custom `resources` next to the role's CPUs/GPUs/NPUs. The router and the controller go
to the Ray head unless `router.placement` says otherwise (Ray's built-in head-node resource), so
the endpoint lives on a node the operator knows, not wherever Ray found room.

Ray keeps an actor that no node could ever host pending forever, and says nothing. So before an
actor is created the controller asks `unplaceable()`: is there a live node with every label and,
in total, every resource the actor reserves? If not, the answer names what no node has; `up`
stops with it, and a replacement (after its node was lost) waits, reported once, until a node
that fits joins. Resources that exist but are taken are Ray's to queue for: the replica then
stays in its "scheduling actor" stage.
"""

from __future__ import annotations

from typing import Any

from pdcluster.config import Placement, Resources

HEAD_RESOURCE = "node:__internal_head__"  # every Ray head node has 1 of it
HEAD_SHARE = 0.001


def demand(resources: Resources, placement: Placement) -> dict[str, float]:
    """What one actor reserves on its node, by Ray resource name."""
    need = {"CPU": resources.cpus, "GPU": resources.gpus, "NPU": resources.npus, **placement.resources}
    return {name: amount for name, amount in need.items() if amount}


def actor_options(resources: Resources, placement: Placement) -> dict[str, Any]:
    """Ray `.options()` for an actor with these resources and placement."""
    options: dict[str, Any] = {"num_cpus": resources.cpus, "num_gpus": resources.gpus}
    custom = {name: amount for name, amount in demand(resources, placement).items() if name not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    if placement.labels:
        options["label_selector"] = dict(placement.labels)
    return options


def orchestrator_options(placement: Placement | None) -> dict[str, Any]:
    """Ray `.options()` for the controller and the router (they reserve no CPU)."""
    if placement is None:
        return {"num_cpus": 0, "resources": {HEAD_RESOURCE: HEAD_SHARE}}
    return actor_options(Resources(), placement)


def orchestrator_placement(placement: Placement | None) -> tuple[Placement, dict[str, float]]:
    """The placement and demand unplaceable() checks for the controller and the router."""
    if placement is None:
        return Placement(), {HEAD_RESOURCE: HEAD_SHARE}
    return placement, demand(Resources(), placement)


def unplaceable(placement: Placement, need: dict[str, float], nodes: list[dict[str, Any]]) -> str | None:
    """None when a live node (of `ray.nodes()`) carries every label of `placement` and has, in
    total, each resource of `need`; else what no live node has, as a message would say it."""
    alive = [node for node in nodes if node.get("Alive")]
    fitting = [node for node in alive if _has_labels(node, placement.labels)]
    if not fitting:
        wanted = ", ".join(f"{key}={value}" for key, value in placement.labels.items())
        seen = "; ".join(f"{node.get('NodeManagerAddress', '?')}: {_shown_labels(node)}" for node in alive)
        return f"no live Ray node has label {wanted} (nodes: {seen or 'none'})"
    if any(_has_resources(node, need) for node in fitting):
        return None
    where = f"with label {_labels_text(placement.labels)} " if placement.labels else ""
    if HEAD_RESOURCE in need and not any(
        _has_resources(node, {HEAD_RESOURCE: need[HEAD_RESOURCE]}) for node in fitting
    ):
        return f"no live Ray node {where}is the head node"
    for name, amount in need.items():
        most = max(float((node.get("Resources") or {}).get(name, 0.0)) for node in fitting)
        if most < amount:
            return f"no live Ray node {where}has resource {name} ≥ {amount:g} (most: {most:g})"
    together = " and ".join(f"{name} ≥ {amount:g}" for name, amount in need.items())
    return f"no live Ray node {where}has {together} together"


def _has_resources(node: dict[str, Any], need: dict[str, float]) -> bool:
    have = node.get("Resources") or {}
    return all(float(have.get(name, 0.0)) >= amount for name, amount in need.items())


def _has_labels(node: dict[str, Any], labels: dict[str, str]) -> bool:
    have = node.get("Labels") or {}
    return all(have.get(key) == value for key, value in labels.items())


def _shown_labels(node: dict[str, Any]) -> str:
    """A node's own labels, without the ones Ray sets on every node (ray.io/...)."""
    own = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
    return _labels_text(own) or "no labels"


def _labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
