"""Logging setup for pdcluster processes (CLI, actors, engine processes).

Only the `pdcluster` logger tree is configured; vLLM and Ray configure their own. Level comes from
PDCLUSTER_LOG_LEVEL (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(levelname)s %(asctime)s [%(name)s pid=%(process)d] %(message)s"


def setup_logging(level: str | None = None) -> None:
    logger = logging.getLogger("pdcluster")
    if any(getattr(h, "_pdcluster", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler._pdcluster = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel((level or os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO")).upper())
    logger.propagate = False


class WarnOnce:
    """Warns once per key (refusals a peer may repeat in a loop must not flood the log); at
    most `limit` keys are remembered, so a peer varying its key cannot grow memory."""

    def __init__(self, logger: logging.Logger, limit: int = 1024):
        self._logger = logger
        self._seen: set = set()
        self._limit = limit

    def __call__(self, key, message: str, *args) -> None:
        if key in self._seen or len(self._seen) >= self._limit:
            return
        self._seen.add(key)
        self._logger.warning(message, *args)
