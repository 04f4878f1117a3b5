"""`model.dtype: native`: the model's own dtype where the engine's CPU computes it natively.

A CPU without bfloat16 (or float16) arithmetic still runs a half-precision model, but torch then
takes its portable GEMM (at::native::cpublas, a dot product per output element with float32
accumulation) instead of oneDNN's vector kernels: every matmul runs several times slower than the
same model in float32 (an AVX2-only x86, e.g., has neither AVX512-BF16 nor AMX). `native` keeps
the model's dtype (vLLM's `auto`) on accelerators and on CPUs that compute it natively, and picks
float32 elsewhere. An explicit half dtype on such a CPU is kept (it was asked for), with a warning
naming `native`.

Resolved per engine, on its host: prefill and decode on CPUs of different kinds would then differ,
and the KV handshake refuses that pair naming both sides; set the dtype explicitly there.
"""

from __future__ import annotations

import json
from pathlib import Path

NATIVE = "native"
HALF = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}
# /proc/cpuinfo feature flags (x86 `flags`, Arm `Features`) that mean native arithmetic in a dtype
NATIVE_FLAGS = {
    "bfloat16": {"avx512_bf16", "amx_bf16", "bf16"},
    "float16": {"avx512_fp16", "amx_fp16", "fphp"},
}


def cpuinfo_field(*names: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first processor's value of the first of `names` found; "" where /proc/cpuinfo cannot
    be read (not Linux) or has none of them."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    return value.strip()
    except OSError:
        return ""
    return ""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first processor's feature flags (x86 `flags`, Arm `Features`); empty where unknown,
    so that nothing is called native."""
    return set(cpuinfo_field("flags", "Features", cpuinfo=cpuinfo).split())


def model_dtype(model: str) -> str | None:
    """The dtype a local model's config.json declares (`torch_dtype`, or `dtype` in newer
    exports); None where that is unknown (a hub id, no file, no field)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value) if value else None


def resolve_dtype(dtype: str, model: str, *, on_cpu: bool, flags: set[str] | None = None) -> tuple[str, str | None]:
    """(the dtype to give vLLM, a warning to log or None) for a configured `dtype`."""
    keep = "auto" if dtype == NATIVE else dtype  # vLLM's auto is the model's own dtype
    own = model_dtype(model) if dtype in (NATIVE, "auto") else dtype
    half = HALF.get(str(own).lower()) if own else None
    if not on_cpu or half is None or (cpu_flags() if flags is None else flags) & NATIVE_FLAGS[half]:
        return keep, None
    wanted = " or ".join(sorted(NATIVE_FLAGS[half]))
    if dtype == NATIVE:
        return "float32", f"model.dtype native: float32 (the model is {half}; this CPU has no {wanted})"
    return dtype, (
        f"{half} on a CPU without {wanted}: torch emulates its matmuls, several times slower than "
        "float32; `model.dtype: native` picks float32 on such CPUs"
    )
