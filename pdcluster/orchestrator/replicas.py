"""Replica lifecycle, shared by the controller (which owns it) and the router (which obeys it),
and the controller's record of one replica (`Replica`).

STARTING  actor created, engine loading; receives no traffic
READY     serving; the router may choose it
DRAINING  scale-down or shutdown: no new requests, in-flight ones finish
DEAD      stopped, crashed or failed to start
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcluster.engine.spec import EngineSpec
from pdcluster.orchestrator.reconcile import Health

if TYPE_CHECKING:
    from pdcluster.config import RoleName


class ReplicaState(enum.IntEnum):
    STARTING = 1
    READY = 2
    DRAINING = 3
    DEAD = 4

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class Replica:
    replica_id: str
    role: RoleName
    index: int
    slot: int  # its place among the role's replicas (reconcile.py): a replacement takes it over
    spec: EngineSpec
    state: ReplicaState = ReplicaState.STARTING
    stage: str = "pending"
    actor: Any = None
    url: str | None = None
    node: str = ""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    health: Health = field(default_factory=Health)
    task: asyncio.Task | None = None
    transitions: list[tuple[float, str]] = field(default_factory=list)

    def set_state(self, state: ReplicaState) -> None:
        if state != self.state or not self.transitions:
            self.transitions.append((time.time(), state.label))
        self.state = state

    def router_row(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "role": self.role,
            "url": self.url or "",
            "state": int(self.state),
            "node": self.node,
            "stats": (self.info or {}).get("stats") or {},
            "rss_bytes": (self.info or {}).get("rss_bytes"),
        }
