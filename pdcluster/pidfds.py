"""Whether a process (held by a pidfd) exited: its pidfd becomes readable.

poll(), not select(): select() refuses descriptors past 1024 (ValueError), and a process holding
many descriptors (connections to its ports, an engine's sockets) gets such numbers."""

from __future__ import annotations

import select


def exited(pidfd: int, timeout_s: float | None = 0) -> bool:
    """True once the process of `pidfd` exited, waiting up to timeout_s (None: until it does)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))
