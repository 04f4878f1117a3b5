"""Replica lifecycle, shared by the controller (which owns it) and the router (which obeys it).

STARTING  actor created, engine loading; receives no traffic
READY     serving; the router may choose it
DRAINING  scale-down or shutdown: no new requests, in-flight ones finish
DEAD      stopped, crashed or failed to start
"""

from __future__ import annotations

import enum


class ReplicaState(enum.IntEnum):
    STARTING = 1
    READY = 2
    DRAINING = 3
    DEAD = 4

    @property
    def label(self) -> str:
        return self.name.lower()
