"""Host addresses: whether a bind address means every interface, and the address this node is
reached at (what a server bound to every interface advertises)."""

from __future__ import annotations

import socket

EVERY_ADDRESS = ("", "0.0.0.0", "::")


def binds_every_address(host: str) -> bool:
    return host in EVERY_ADDRESS


def node_ip() -> str:
    """This node's Ray address; outside Ray (tests), its hostname."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): fall back to the hostname
        return socket.gethostname()
