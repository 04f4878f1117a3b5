"""Router relay cost: CPU the router spends per streamed token event, and what it costs the client.

A stand-in replica (its own process, plain asyncio HTTP/1.1) streams each request's SSE events
one chunked write apiece, paced like a decode engine (one event per stream every `--gap-ms`), as
vLLM's server does for one token per step. The router (its own process: the real `Router` app
under uvicorn) relays them to this process, which runs `--streams` concurrent streaming clients
(httpx). Per setup: the router's and the client's CPU time per event (psutil). Baseline in the
same run: the clients read the replica directly, no router.

Modes (`--modes`): `aggregated`, the router relays the replica's stream as it is; `pd`, the
disaggregated path with the first token from the prefill: the same stand-in answers the prefill
(one token and its kv_transfer_params) and then streams the continuation, which the router
rewrites event by event into the client's own request.

`--routers label=DIR ...` runs the router from other checkouts too (e.g. a git worktree of an
older commit), alternating with this one in every repeat, for a before/after in one run.
Results: bench/results/<date>-router-relay.{json,md}.

Usage: python bench/router_relay.py [--streams 16] [--events 300] [--gap-ms 5] [--repeats 3]
       [--routers before=/path/to/old/checkout] [--modes aggregated pd]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, machine, write_results
from pdcluster.orchestrator.session import free_port

EVENT = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764567890,'
    b'"model":"tiny","choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null}],"usage":null}\n\n'
)

REPLICA = r"""
import asyncio, json, re, sys
EVENT, COUNT, GAP = sys.argv[1].encode(), int(sys.argv[2]), float(sys.argv[3])

PREFILL = json.dumps({"id": "cmpl-p", "created": 1, "model": "tiny", "kv_transfer_params": {"remote_num_tokens": 1},
                      "choices": [{"index": 0, "text": " first", "finish_reason": "length", "token_ids": [42],
                                   "prompt_token_ids": [1]}]}).encode()

async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1)) if length else 0)
            if json.loads(body).get("stream") is False:  # the prefill of a P/D request
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(PREFILL), PREFILL))
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(COUNT):
                writer.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
                await writer.drain()
                await asyncio.sleep(GAP)
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[4]))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""

ROUTER = r"""
import asyncio, sys
from pdcluster.orchestrator.replicas import ReplicaState
from pdcluster.orchestrator.router import Router, RouterSettings

async def main():
    mode = sys.argv[3]
    roles = ["aggregated"] if mode == "aggregated" else ["prefill", "decode"]
    router = Router(RouterSettings(model_name="tiny", mode=mode, engine_token="bench-engine-key"))
    router.update_replicas([{"replica_id": f"{role}-0", "role": role, "url": sys.argv[1],
                             "state": int(ReplicaState.READY), "node": "127.0.0.1", "stats": {}} for role in roles])
    await router.start("127.0.0.1", int(sys.argv[2]))
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _start(code: str, args: list[str], cwd: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )
    line = proc.stdout.readline()  # blocks until the server says it listens
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc


async def _drive(url: str, streams: int) -> tuple[int, float]:
    """Run `streams` concurrent streaming requests; (events received, client CPU seconds)."""

    async def one(client: httpx.AsyncClient) -> int:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
        count = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                count += line.startswith("data: {")
        return count

    cpu = time.process_time()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=streams)) as client:
        counts = await asyncio.gather(*(one(client) for _ in range(streams)))
    return sum(counts), time.process_time() - cpu


MODES = {"aggregated": "aggregated", "pd": "disaggregated"}  # --modes -> RouterSettings.mode


def measure(label: str, src: Path | None, mode: str, replica_url: str, streams: int) -> dict:
    router = None
    url = replica_url
    if src is not None:
        port = free_port()
        router = _start(ROUTER, [replica_url, str(port), MODES[mode]], src)
        url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_drive(url, 2))  # warm-up: connections, first-request paths
        before = psutil.Process(router.pid).cpu_times() if router else None
        events, client_cpu = asyncio.run(_drive(url, streams))
        after = psutil.Process(router.pid).cpu_times() if router else None
    finally:
        if router is not None:
            router.kill()
            router.wait()
    router_cpu = (after.user + after.system - before.user - before.system) if router else 0.0
    return {
        "setup": label,
        "mode": mode,
        "events": events,
        "router_us_per_event": 1e6 * router_cpu / events,
        "client_us_per_event": 1e6 * client_cpu / events,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--events", type=int, default=300, help="events per stream")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between a stream's events")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--routers",
        nargs="*",
        default=[],
        metavar="LABEL=DIR",
        help="also run the router from these checkouts (before/after in one run)",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args(argv)
    checkouts = [("router", ROOT)]
    for item in args.routers:
        label, _, path = item.partition("=")
        checkouts.append((f"router ({label})", Path(path).resolve()))
    setups: list[tuple[str, Path | None, str]] = [("direct (no router)", None, "aggregated")]
    for mode in args.modes:
        for label, src in checkouts:
            setups.append((label if mode == "aggregated" else label.replace("router", "router, P/D", 1), src, mode))

    port = free_port()
    replica = _start(REPLICA, [EVENT.decode(), str(args.events), str(args.gap_ms / 1000), str(port)], ROOT)
    rows: list[dict] = []
    try:
        for repeat in range(args.repeats):
            # Odd repeats run the routers in reverse order, so that none always runs first.
            for label, src, mode in setups if repeat % 2 == 0 else [setups[0], *setups[:0:-1]]:
                row = measure(label, src, mode, f"http://127.0.0.1:{port}", args.streams)
                rows.append({**row, "repeat": repeat})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        replica.kill()
        replica.wait()

    lines = [
        "# Router relay cost",
        "",
        f"{args.streams} concurrent streams x {args.events} events, one event per stream every {args.gap_ms} ms "
        "(a stand-in replica writes each event on its own, as vLLM's server does per token); CPU time per "
        f"relayed event, median of {args.repeats} alternating repeats (odd ones in reverse order). `direct`: "
        "the same clients read the replica without the router (baseline). `P/D`: the disaggregated path, the "
        "first token from the prefill and the decode replica's continuation rewritten for the client (one "
        "event more per stream). Machine: " + json.dumps(machine()),
        "",
        "| setup | events | router CPU / event (us) | client CPU / event (us) | client vs direct |",
        "|---|---:|---:|---:|---:|",
    ]

    def expected(mode: str) -> int:
        return args.streams * (args.events + (mode == "pd"))  # P/D: the prefill's token too

    medians = {}
    for label, _, mode in setups:
        mine = [r for r in rows if r["setup"] == label]
        medians[label] = {
            k: statistics.median(r[k] for r in mine) for k in ("router_us_per_event", "client_us_per_event")
        }
        if any(r["events"] != expected(mode) for r in mine):
            lines.append(f"| {label} | LOST EVENTS: {[r['events'] for r in mine]} of {expected(mode)} | | | |")
    direct = medians["direct (no router)"]["client_us_per_event"]
    for label, _, mode in setups:
        m = medians[label]
        lines.append(
            f"| {label} | {expected(mode)} | {m['router_us_per_event']:.1f} | {m['client_us_per_event']:.1f} | "
            f"{m['client_us_per_event'] / direct:.2f}x |"
        )
    path = write_results(
        "router-relay", {"args": vars(args), "machine": machine(), "rows": rows}, "\n".join(lines) + "\n"
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
