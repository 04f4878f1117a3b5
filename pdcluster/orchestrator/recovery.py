"""The controller's record of its cluster, and a restarted controller taking the cluster back.

The controller is one process; its death (the OOM killer, a crash, a stray `kill`) took the whole
cluster down: the router and every replica were actors it owned, and Ray ends an owner's actors
with it. Every request in flight was lost and the endpoint answered nothing until an operator ran
`down` and `up`. Now the router and the replicas are detached actors that serve on while no
controller runs, and Ray restarts the controller (`up`: max_restarts). The controller keeps a
record of the cluster in Ray's GCS key-value store, written whenever it changes (what the actors
cannot say themselves: each replica's slot and state, each role's size after `scale`, the
router's endpoint). A restarted controller reads it and takes the live actors back by name:
ready replicas serve on, a draining one drains on; one that was starting (its start's caller
died) is killed and its slot refilled, as is the slot of a replica that died meanwhile; a
router that died meanwhile is started again on its endpoint. Replica actors of the cluster the
record does not name (started in the instant before the death) are killed. What the record does
not keep starts afresh: restart budgets, the list of retired replicas, the planner's window.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from pdcluster.orchestrator.replicas import Replica, ReplicaState

if TYPE_CHECKING:
    from pdcluster.orchestrator.controller import Controller

logger = logging.getLogger(__name__)

KV_NAMESPACE = "pdcluster"  # the GCS key-value namespace of the records
KEPT = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING)  # states a record keeps


def record_key(cluster: str, namespace: str) -> str:
    return f"controller/{namespace}/{cluster}"  # a cluster's name is unique within its namespace


def router_name(cluster: str) -> str:
    return f"{cluster}-router"


def replica_name(cluster: str, replica_id: str) -> str:
    return f"{cluster}-{replica_id}"


def cluster_actor_names(cluster: str, namespace: str) -> list[str]:
    """The names of the router and replica actors of `cluster` alive in Ray's `namespace`."""
    import ray

    mine = re.compile(rf"{re.escape(cluster)}-(router|(prefill|decode|aggregated)-\d+)")
    return [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and mine.fullmatch(actor["name"])
    ]


def kill_cluster_actors(cluster: str, namespace: str, spare: Collection[str] = ()) -> list[str]:
    """Kill the router and replica actors of `cluster` (but those named in `spare`): they are
    detached, and none may outlive its cluster; the names killed."""
    import ray

    killed = []
    for name in cluster_actor_names(cluster, namespace):
        if name in spare:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            continue  # gone meanwhile
        killed.append(name)
    return killed


def end_cluster(cluster: str, namespace: str) -> None:
    """Kill whatever actors of `cluster` are left and remove its record: nothing of it outlives
    `down`, nor a restarted controller's fresh start (a failure is logged: `down` goes on)."""
    import ray

    try:
        for name in kill_cluster_actors(cluster, namespace):
            logger.warning("killed %s: left behind", name)
        Record(cluster, namespace).clear()
    except (ray.exceptions.RayError, ConnectionError) as exc:
        logger.warning("cannot remove what is left of cluster %s: %s", cluster, exc)


def _kv():
    """Ray's GCS key-value store (where Ray Serve's controller keeps its checkpoint too)."""
    from ray.experimental import internal_kv

    return internal_kv


class Record:
    """The controller's record of cluster `cluster` (of Ray namespace `namespace`) in the GCS
    key-value store."""

    def __init__(self, cluster: str, namespace: str) -> None:
        self.key = record_key(cluster, namespace)
        self._written: str | None = None

    def save(self, controller: Controller) -> None:
        """Write the controller's state where it differs from the last write."""
        text = json.dumps(snapshot(controller), sort_keys=True)
        if text != self._written:
            _kv()._internal_kv_put(self.key, text, overwrite=True, namespace=KV_NAMESPACE)
            self._written = text

    def load(self) -> dict[str, Any] | None:
        raw = _kv()._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else None

    def clear(self) -> None:
        _kv()._internal_kv_del(self.key, namespace=KV_NAMESPACE)
        self._written = None


def snapshot(controller: Controller) -> dict[str, Any]:
    """What a restarted controller needs and its actors cannot tell it."""
    config = controller.config
    return {
        "sizes": {role: config.role(role).replicas for role in config.serving_roles()},
        "replicas": [
            {
                "replica_id": r.replica_id,
                "role": r.role,
                "index": r.index,
                "slot": r.slot,
                "state": r.state.label,
                "url": r.url,
                "node": r.node,
                "created_at": r.created_at,
                "ready_at": r.ready_at,
                "transitions": r.transitions,
            }
            for pool in controller.pools.values()
            for r in pool
            if r.state in KEPT
        ],
        "router": {"endpoint": controller.routers.endpoint, "restarts": controller.routers.restarts},
        "next_index": controller.next_index,
        "started_at": controller.started_at,
        "restarts": controller.restarts,
    }


def _actor(name: str, namespace: str):
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None  # no live actor of that name


def recover(controller: Controller, record: dict[str, Any]) -> None:
    """Take back the cluster `record` describes (see the module's docstring); the controller's
    monitor, started next, refills the empty slots."""
    import ray

    from pdcluster.orchestrator.engines import engine_spec

    config, namespace = controller.config, controller.config.ray.namespace
    for role, size in record["sizes"].items():
        config.role(role).replicas = size
    controller.started_at = record["started_at"]
    controller.next_index.update(record["next_index"])
    controller.restarts = record["restarts"] + 1
    kept: set[str] = set()
    for row in record["replicas"]:
        role, replica_id = row["role"], row["replica_id"]
        name = replica_name(config.name, replica_id)
        actor = _actor(name, namespace)
        state = ReplicaState[row["state"].upper()]
        if actor is None:
            logger.warning("replica %s (%s) is gone: its slot is refilled", replica_id, row["state"])
            continue
        if state == ReplicaState.STARTING:  # its start's caller died: nobody would hear it end
            ray.kill(actor, no_restart=True)
            logger.warning("replica %s was starting: killed, its slot is refilled", replica_id)
            continue
        replica = Replica(
            replica_id, role, row["index"], row["slot"], engine_spec(config, role, row["slot"], replica_id)
        )
        replica.actor, replica.url, replica.node, replica.ready_at = actor, row["url"], row["node"], row["ready_at"]
        replica.created_at, replica.transitions = row["created_at"], [tuple(t) for t in row["transitions"]]
        replica.state = state
        replica.stage = state.label
        controller.pools[role].append(replica)
        kept.add(name)
        if state == ReplicaState.DRAINING:
            controller.drain(replica)
    router = _actor(router_name(config.name), namespace)
    kept.add(router_name(config.name))
    for name in kill_cluster_actors(config.name, namespace, spare=kept):
        logger.warning("killed %s: an actor of this cluster its record does not name", name)
    controller.routers.adopt(router, record["router"]["endpoint"], record["router"]["restarts"])
    logger.warning(
        "controller restarted (%d restart(s)): took back %s; the router %s",
        controller.restarts,
        ", ".join(sorted(kept - {router_name(config.name)})) or "no replica",
        "serves on" if router is not None else "is gone: a new one is starting",
    )
