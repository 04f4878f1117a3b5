"""Soak: N streaming clients for M minutes against the CPU cluster, scaling decode up and down
in the middle. Checks: no failed or lost request, every response complete (all tokens, finish
reason `length`), router and worker memory flat after warm-up (RSS drift), KV blocks back to
their baseline at the end. Results: bench/results/<date>-soak.{json,md}.

Usage: python bench/soak.py [--clients 8] [--minutes 10] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    MODEL,
    base_config,
    cluster,
    machine,
    metric_samples,
    pdcluster,
    rss_by_role,
    status,
    write_results,
)


def client_loop(
    endpoint: str,
    prompts: list[str],
    max_tokens: int,
    stop: threading.Event,
    tally: dict,
    lock: threading.Lock,
    seed: int,
) -> None:
    i = seed
    with httpx.Client(base_url=endpoint, timeout=300) as http:
        while not stop.is_set():
            body = {
                "model": "tiny",
                "prompt": prompts[i % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            i += 7
            with lock:
                tally["sent"] += 1
            outcome, tokens, finish = "failed", 0, None
            try:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code == 200:
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise RuntimeError(str(event["error"])[:200])
                            for choice in event.get("choices") or ():
                                finish = choice.get("finish_reason") or finish
                            if event.get("usage"):
                                tokens = event["usage"]["completion_tokens"]
                        outcome = "complete" if (tokens == max_tokens and finish == "length") else "incomplete"
                    else:
                        tally_error(tally, lock, f"HTTP {response.status_code}")
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                tally_error(tally, lock, repr(exc)[:200])
            with lock:
                tally[outcome] += 1


def tally_error(tally: dict, lock: threading.Lock, error: str) -> None:
    with lock:
        tally["errors"][error] = tally["errors"].get(error, 0) + 1


def scrape(endpoint: str) -> dict:
    """Router and per-replica memory, KV usage and running sequences from /metrics."""
    snap: dict = {"router_rss": None, "rss": {}, "kv_cache_usage": {}, "running": {}}
    keys = {
        "pdcluster_replica_rss_bytes": "rss",
        "pdcluster_replica_kv_cache_usage": "kv_cache_usage",
        "pdcluster_replica_running": "running",
    }
    for name, labels, value in metric_samples(httpx.get(endpoint + "/metrics", timeout=60).text):
        if name == "pdcluster_router_rss_bytes":
            snap["router_rss"] = value
        elif name in keys:
            snap[keys[name]][labels["replica"]] = value
    return snap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in (MODEL / "heldout_prompts.jsonl").read_text().splitlines()]
    duration = args.minutes * 60
    config = base_config("bench-soak")
    samples, events = [], []
    tally = {"sent": 0, "complete": 0, "incomplete": 0, "failed": 0, "errors": {}}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="pdcluster-soak-") as tmp, cluster(config, Path(tmp)) as endpoint:
        home = Path(tmp) / f"home-{config['name']}"
        baseline = scrape(endpoint)
        stop = threading.Event()
        threads = [
            threading.Thread(target=client_loop, args=(endpoint, prompts, args.max_tokens, stop, tally, lock, k))
            for k in range(args.clients)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()

        def scaler() -> None:
            # Scale decode up at 1/4 of the run, and down once two decode replicas have served
            # for a while (engine start takes minutes on 2 busy cores), through the CLI as an
            # operator would.
            for n, at in (
                (2, lambda: started + duration / 4),
                (1, lambda: max(started + duration / 2, time.monotonic() + duration / 6)),
            ):
                if stop.wait(max(0.0, at() - time.monotonic())):
                    return
                t0 = time.monotonic()
                pdcluster(home, "scale", "decode", str(n), "--wait", "--name", config["name"])
                events.append(
                    {"at_s": round(t0 - started, 1), "scale": f"decode={n}", "took_s": round(time.monotonic() - t0, 1)}
                )

        scaling = threading.Thread(target=scaler)
        scaling.start()
        while time.monotonic() - started < duration:
            # Memory and queue samples from the router's /metrics (cheap: no Ray driver per sample).
            snap = scrape(endpoint)
            samples.append(
                {"t": round(time.monotonic() - started, 1), "sent": tally["sent"], "procs": rss_by_role(), **snap}
            )
            stop.wait(5)  # sampling interval of the soak monitor
        stop.set()
        for t in threads:
            t.join(600)
        scaling.join(900)
        settle_deadline = time.monotonic() + 60
        while time.monotonic() < settle_deadline:
            final = scrape(endpoint)
            if all(v == 0.0 for v in final["kv_cache_usage"].values()) and not any(final["running"].values()):
                break
            time.sleep(1)  # blocks return once the last leases are released
        transitions = {r["replica"]: [s for _, s in r["transitions"]] for r in status(config, Path(tmp))["replicas"]}

    warm = [s for s in samples if s["t"] >= duration * 0.15]

    def drift(key_fn):
        values = [v for v in (key_fn(s) for s in warm) if v]
        if len(values) < 4:
            return None
        quarter = max(1, len(values) // 4)
        first, last = sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter
        return (last - first) / first

    drifts = {"router": drift(lambda s: s["router_rss"])}
    for replica in ("prefill-0", "decode-0"):
        drifts[replica] = drift(lambda s, r=replica: s["rss"].get(r))
    roles = sorted({role for s in warm for role in s["procs"]})
    process_drifts = {role: drift(lambda s, r=role: s["procs"].get(r)) for role in roles}
    kv_back = final["kv_cache_usage"]
    lost = tally["sent"] - tally["complete"] - tally["incomplete"] - tally["failed"]
    result = {
        "clients": args.clients,
        "minutes": args.minutes,
        "max_tokens": args.max_tokens,
        "tally": tally,
        "lost": lost,
        "scale_events": events,
        "rss_drift": drifts,
        "rss_drift_by_process": process_drifts,
        "kv_cache_usage_end": kv_back,
        "kv_cache_usage_start": baseline["kv_cache_usage"],
        "replica_states": transitions,
        "samples": samples,
    }
    ok = (
        tally["failed"] == 0
        and tally["incomplete"] == 0
        and lost == 0
        and all(v == 0.0 for v in kv_back.values())
        and len(events) == 2
    )
    lines = [
        f"# Soak: {args.clients} streaming clients, {args.minutes:g} min, decode scaled 1 -> 2 -> 1",
        "",
        f"- requests: {tally['sent']} sent, {tally['complete']} complete ({args.max_tokens} tokens, finish_reason=length), "
        f"{tally['incomplete']} incomplete, {tally['failed']} failed, {lost} lost; errors: {tally['errors'] or 'none'}",
        f"- scale events: {events}; replica states: {transitions}",
        "- RSS drift after warm-up (last quarter vs first quarter of samples): "
        + ", ".join(f"{k} {'-' if v is None else f'{v * 100:+.1f}%'}" for k, v in drifts.items()),
        "- by process (summed per role on this machine): "
        + ", ".join(f"{k} {'-' if v is None else f'{v * 100:+.1f}%'}" for k, v in process_drifts.items()),
        f"- KV cache usage at the end: {kv_back}",
        "",
        f"Verdict: **{'pass' if ok else 'FAIL'}** (both scale events done; no failed/lost/incomplete request; KV blocks back to baseline).",
        "",
    ]
    path = write_results("soak", {"machine": machine(), **result}, "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
