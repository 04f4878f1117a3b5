"""Standalone launcher: run one EngineHost in this process, outside Ray.

Used by the KV connector tests (prefill and decode engines in separate processes) and by anyone
who wants a single engine of a given role. Prints one JSON line on stdout when ready:
    {"event": "ready", "url": "http://127.0.0.1:PORT", "engine_id": ...}
and serves until SIGINT/SIGTERM (exit 0), or until its engine dies (exit 1). Logs go to stderr.

Usage: python -m pdcluster.engine.serve --spec-json '{...EngineSpec...}' --secret-file PATH
(the cluster secret: the engine's HTTP app takes only requests carrying the key derived from it,
`Authorization: Bearer <pdcluster.keys.engine_http_token(secret)>`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pdcluster.engine.spec import EngineSpec
from pdcluster.logs import setup_logging

logger = logging.getLogger("pdcluster.engine.serve")


async def run(spec: EngineSpec, secret: str) -> int:
    """Serve until SIGINT/SIGTERM (0) or until the engine stops serving on its own: its engine
    core died and vLLM's app stopped the HTTP server (1)."""
    from pdcluster.engine.host import EngineHost

    host = EngineHost(spec, secret)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await host.start()
        sys.stdout.write(json.dumps({"event": "ready", "url": url, "engine_id": spec.engine_id}) + "\n")
        sys.stdout.flush()
        stopped, served = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(host.serving())
        await asyncio.wait({stopped, served}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopped, served):
            task.cancel()
        if stop.is_set():
            return 0
        logger.error("engine %s stopped serving: its engine died", spec.engine_id)
        return 1
    finally:
        await host.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-json", required=True, help="EngineSpec as JSON")
    parser.add_argument("--secret-file", required=True, help="file holding the cluster secret")
    args = parser.parse_args(argv)
    setup_logging()
    spec = EngineSpec.from_json(args.spec_json)
    try:
        secret = Path(args.secret_file).read_text().strip()
    except OSError as exc:
        parser.exit(2, f"pdcluster.engine.serve: --secret-file: {exc}\n")
    if not secret:
        parser.exit(2, f"pdcluster.engine.serve: --secret-file: {args.secret_file} is empty\n")
    # This process exists only to run this engine: its environment is the engine's.
    os.environ.update(spec.env())
    return asyncio.run(run(spec, secret))


if __name__ == "__main__":
    sys.exit(main())
