"""Matmul throughput of the bench model's shapes per dtype on this CPU: why `model.dtype: native`.

One thread (an engine's, as the default cluster binds them), torch's linear layer on the tiny
model's projections (hidden 256, MLP 768, vocabulary 4096), for a prefill chunk (1536 tokens) and a
decode batch (8 tokens); bfloat16 and float32 in the same run, alternating, best of several
repeats. Reports the CPU's half-precision flags, what `native` resolves to here, and bfloat16's
time as a multiple of float32's.

Writes bench/results/<date>-cpu-dtype.{md,json}.
Usage: python bench/cpu_dtype.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MODEL, machine, write_results  # noqa: E402
from pdcluster.engine.dtype import NATIVE_FLAGS, cpu_flags, cpuinfo_field, resolve_dtype  # noqa: E402

SHAPES = {"q/k/v/o": (256, 256), "mlp up": (256, 768), "mlp down": (768, 256), "lm head": (256, 4096)}
TOKENS = {"prefill chunk": 1536, "decode batch": 8}
DTYPES = ("float32", "bfloat16")


def seconds(tokens: int, dtype: torch.dtype, budget_s: float = 0.2) -> float:
    """One pass over every projection, seconds (the mean over as many passes as fit the budget)."""
    pairs = [(torch.randn(tokens, i, dtype=dtype), torch.randn(o, i, dtype=dtype)) for i, o in SHAPES.values()]
    for x, w in pairs:  # warm-up: kernels chosen, buffers allocated
        torch.nn.functional.linear(x, w)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or n < 3:
        for x, w in pairs:
            torch.nn.functional.linear(x, w)
        n += 1
    return (time.perf_counter() - start) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    flags = cpu_flags()
    half = sorted(flags & set().union(*NATIVE_FLAGS.values()))
    native, _ = resolve_dtype("native", str(MODEL), on_cpu=True)
    rows = {}
    for label, tokens in TOKENS.items():
        best = {name: float("inf") for name in DTYPES}
        for _ in range(args.repeats):
            for name in DTYPES:  # alternating: the machine's noise falls on both
                best[name] = min(best[name], seconds(tokens, getattr(torch, name)))
        rows[label] = {"tokens": tokens, **{f"{k}_ms": v * 1e3 for k, v in best.items()}}
        rows[label]["bf16_over_fp32"] = best["bfloat16"] / best["float32"]
        print(label, rows[label], flush=True)
    lines = [
        f"# Matmul time per dtype on this CPU, {time.strftime('%Y-%m-%d')}",
        "",
        f"The bench model's projections ({', '.join(f'{k} {i}×{o}' for k, (i, o) in SHAPES.items())}), one "
        f"thread, best of {args.repeats} alternating repeats. Half-precision flags: "
        f"{', '.join(half) or 'none'}; `model.dtype: native` resolves to **{native}** here "
        "(`auto`: the model's bfloat16).",
        "",
        "| pass | tokens | float32 ms | bfloat16 ms | bfloat16 / float32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['tokens']} | {r['float32_ms']:.2f} | {r['bfloat16_ms']:.2f} | {r['bf16_over_fp32']:.2f}× |"
        )
    simd = sorted(flags & {"avx2", "avx512f", "amx_tile", "asimd", "sve"})
    lines += [
        "",
        f"Machine: {machine()}, CPU {cpuinfo_field('model name') or 'unknown'!r} ({', '.join(simd)}), torch {torch.__version__}",
    ]
    payload = {"rows": rows, "half_flags": half, "native": native, "machine": machine()}
    print(write_results("cpu-dtype", payload, "\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
