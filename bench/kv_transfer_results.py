"""bench/kv_transfer.py's results: the issues' targets, what each transport does, and the files.

bench/results/<date>-kv-transfer-<label>.{json,md}: a row per token count and transport (GB/s,
ratios to memcpy, to grpc when grpc is in the run, and to each ceiling measured), each target
of the run's mode met or missed (reported, never a failure), and how each transport moves bytes.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import os
import platform

import torch

# (transport, mode) -> (row key, least value, where it comes from); collective has none on CPU
TARGETS = {
    ("grpc", "single-host"): ("ratio_to_memcpy", 0.25, "issue 3"),
    ("shm", "single-host"): ("ratio_to_memcpy", 0.6, "issue 8"),
    ("mooncake", "single-host"): ("ratio_to_memcpy", 0.2, "issue 22"),
    ("mooncake", "cross-host"): ("ratio_to_grpc", 2.5, "issue 22"),
}
HOW = {
    "grpc": "grpc: gather on the producer, encode, stream, decode, scatter into scattered block ids.",
    "shm": "shm (direct): the producer writes half the layers into the consumer's cache while the "
    "consumer reads the other half from the producer's (process_vm_writev/readv), one copy per "
    "byte; gRPC carries control only.",
    "shm-ring": "shm ring: the producer gathers chunks into a ring of 4 slots in /dev/shm while the "
    "consumer scatters earlier chunks out of it (2 copies per byte, pipelined on 2 processes).",
    "collective": "collective: gloo send/recv on a pair group over {net}, gather into and "
    "scatter out of double buffers; gRPC carries control only.",
    "mooncake": "mooncake: the consumer reads the leased blocks with Mooncake's transfer engine over "
    "{net}: where the runs of blocks average >= 1 MiB a layer, straight from the producer's "
    "registered cache into its own (one batched read, a descriptor per run of blocks per layer); "
    "shorter runs staged: the producer gathers them into registered chunks (32 MiB), each read "
    "with one descriptor and scattered into the consumer's blocks; gRPC carries control and the lease.",
    "mooncake-in-place": "mooncake-in-place: the mooncake backend always reading in place (a "
    "descriptor per run of blocks per layer, however short), as before staged reads of short runs.",
    "mooncake-staged": "mooncake-staged: the mooncake backend always reading staged into a landing buffer "
    "and scattering, however long the runs.",
}
LOOPBACK = "127.0.0.1 TCP"  # HOW's {net} on one host
CEILINGS = {"grpc": "raw gRPC", "tcp": "raw TCP", "mooncake": "raw Mooncake"}  # row key raw_<name>_GBps -> column label
COLUMNS = {"ratio_to_memcpy": "transfer / memcpy", "ratio_to_grpc": "transfer / grpc"}  # target row keys


def result_name(args, transport: str) -> str:
    """A transport's name in the results: shm with --shm-ring is shm-ring."""
    return "shm-ring" if transport == "shm" and args.shm_ring else transport


def verdicts(args, rows: list[dict]) -> list[dict]:
    """Each transport's target in this mode (--target: a ratio to memcpy for every transport),
    its worst row among those it pulled, the token counts it failed at, and whether it is met
    (missed where a pull failed; None: not measurable in this run, e.g. no grpc to compare with)."""
    found = []
    for transport in args.transports:
        name = result_name(args, transport)
        if args.target is not None:
            target = ("ratio_to_memcpy", args.target, "--target")
        elif (target := TARGETS.get((transport, args.mode))) is None:
            continue
        key, least, source = target
        mine = [r for r in rows if r["transport"] == name]
        failed = [r["tokens"] for r in mine if r["error"]]
        values = [r[key] for r in mine if not r["error"]]
        worst = None if None in values or not values else min(values)
        met = False if failed else None if worst is None else worst >= least
        found.append(
            {"transport": name, "metric": key, "target": least, "source": source, "worst": worst}
            | {"failed_tokens": failed, "met": met}
        )
    return found


def target_lines(names: list[str], found: list[dict]) -> list[str]:
    lines = ["", "Targets (reported here; they never fail the run):"]
    for v in found:
        what = f"{v['transport']}: {COLUMNS[v['metric']]} >= {v['target']}x ({v['source']})"
        worst = "no row pulled" if v["worst"] is None else f"worst row {v['worst']:.2f}x"
        if v["failed_tokens"]:
            worst = f"pulls failed at {', '.join(map(str, v['failed_tokens']))} tokens; {worst}"
        if v["met"] is None:
            lines.append(f"- {what}: not measured (no grpc row to compare with)")
        else:
            lines.append(f"- {what}: **{'met' if v['met'] else 'MISSED'}** ({worst})")
    without = [n for n in names if n not in {v["transport"] for v in found}]
    if without:
        lines.append(f"- no target in this mode: {', '.join(without)}")
    return lines


def cell(row: dict, key: str) -> str:
    """A table cell: GB/s as is, ratios with an x (bold where against memcpy or grpc)."""
    value = row[key]
    if value is None:
        return "failed" if key == "transfer_GBps" else "-"
    if not key.startswith("ratio_"):
        return f"{value:.2f}"
    return f"**{value:.2f}x**" if key in COLUMNS else f"{value:.2f}x"


def write_results(args, rows: list[dict], method: str, label=None, net=LOOPBACK, notes=(), **extra) -> None:
    """bench/results/<date>-kv-transfer-<label>.{json,md}. label: default the transports' names;
    net: how HOW's lines name the network; `notes`: more lines under the table; `extra`: more
    top-level JSON keys."""
    label = label or args.name
    stamp = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = [c for c in CEILINGS if any(r.get(f"raw_{c}_GBps") for r in rows)]
    names = list(dict.fromkeys(r["transport"] for r in rows))
    versus_grpc = "grpc" in names and len(names) > 1
    found = verdicts(args, rows)
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "transport": args.name,
        "transports": names,
        **extra,
        "layout": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "dtype": "bfloat16",
            "chunk_bytes": args.chunk_bytes,
        },
        "machine": {
            "cpus": mp.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            # the machine is shared: 1-minute load average before and after the run
            "loadavg_1m": [args.load_before, os.getloadavg()[0]],
        },
        "method": method,
        "repeats": args.repeats,
        "targets": found,
        "rows": rows,
    }
    name = f"{stamp}-kv-transfer-{label}"
    (args.out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    heads = " transfer / grpc |" if versus_grpc else ""
    heads += "".join(f" {CEILINGS[c]} GB/s | transfer / {CEILINGS[c]} |" for c in ceilings)
    lines = [
        f"# KV transfer benchmark ({label}), {meta['date']}",
        "",
        f"Layout: {args.layers} layers, {args.kv_heads} KV heads, head dim {args.head_dim}, bf16, "
        f"block size {args.block_size}; chunks of {args.chunk_bytes >> 20} MiB. {meta['method']}. "
        f"Repeats: {args.repeats} per transport (x 8192 / tokens below 8192 tokens) after one warm-up "
        f"pull each, checked byte for byte. Machine: {meta['machine']['cpus']} CPUs, shared; 1-min load average "
        f"{meta['machine']['loadavg_1m'][0]:.1f} before, {meta['machine']['loadavg_1m'][1]:.1f} after.",
        "",
        f"| tokens | MiB | transport | transfer GB/s | memcpy GB/s | transfer / memcpy |{heads} staging only GB/s "
        "| CPU cores busy |",
        "|---:|---:|:---|---:|---:|---:|" + "---:|" * versus_grpc + "---:|---:|" * len(ceilings) + "---:|---:|",
    ]
    for r in rows:
        keys = ["transfer_GBps", "memcpy_GBps", "ratio_to_memcpy", "ratio_to_grpc"][: 4 if versus_grpc else 3]
        keys += [k for c in ceilings for k in (f"raw_{c}_GBps", f"ratio_to_raw_{c}")]
        cells = [f"{r['tokens']}", f"{r['bytes'] / 2**20:.0f}", r["transport"]] + [cell(r, k) for k in keys]
        cells += [cell(r, "staging_only_GBps"), cell(r, "cpu_cores_busy")]
        lines.append(f"| {' | '.join(cells)} |")
    lines += target_lines(names, found)
    lines += [f"- {r['transport']} at {r['tokens']} tokens failed: {r['error']}" for r in rows if r["error"]]
    lines += ["", "- transfer: cache-to-cache pull through the connector's transport (handshake done once)."]
    lines += [f"  {HOW[n].format(net=net)}" for n in names]
    if versus_grpc:
        lines.append("- transfer / grpc: the grpc backend's median pull time over this one's, same tokens, same run.")
    if any(n.startswith("mooncake") for n in names):
        runs = {r["tokens"]: r["block_runs"] for r in rows}
        lines.append(
            "- mooncake read in place: one descriptor per layer and run of blocks consecutive on both sides, "
            "all in one batch: " + ", ".join(f"{runs[t] * args.layers} at {t} tokens" for t in runs) + "."
        )
        modes = [
            f"{r['transport']} at {r['tokens']} tokens: "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["read_modes"].items()))
            for r in rows
            if r.get("read_modes")
        ]
        if modes:
            lines.append(
                "- how each mooncake pull was read (in_place; staged: chunks read into the consumer's rows; "
                "landed: chunks read into a landing buffer and scattered): " + "; ".join(modes) + "."
            )
    if any(r["error"] and r["transport"].startswith("mooncake") and r["block_runs"] * args.layers > 2048 for r in rows):
        lines.append(
            "  Its failed pulls had more than 2048 descriptors: Mooncake 0.3.13's TCP transport queues at most "
            "2048 per peer, logs `TCP lane queue-full rejection` for the rest and fails the whole batch."
        )
    if "grpc" in ceilings:
        lines += [
            "- raw gRPC: the same byte count as fresh chunk-sized messages through grpcio with the",
            "  same channel options and no KV work — the ceiling any gRPC transport can reach here.",
        ]
    lines += [
        "- staging only: gather + scatter in one process (no transport).",
        "- CPU cores busy: user+system CPU of producer and consumer per second of transfer.",
        *notes,
    ]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / name}.md")
