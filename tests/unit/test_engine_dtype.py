"""`model.dtype: native` (engine/dtype.py): the model's own half dtype only where the CPU computes
it natively; float32 where torch would emulate it. Read from the shipped model's config.json and
from /proc/cpuinfo-formatted text."""

from __future__ import annotations

from pdcluster.engine.dtype import cpu_flags, model_dtype, resolve_dtype
from tests.support.engines import MODEL as TINY_MODEL

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # an AVX2-only x86 (no AVX-512, no AMX)


def test_native_keeps_the_models_dtype_where_the_cpu_computes_it():
    assert model_dtype(str(TINY_MODEL)) == "bfloat16"
    for flags in ({*AVX2_ONLY, "avx512f", "avx512_bf16"}, {*AVX2_ONLY, "amx_tile", "amx_bf16"}, {"asimd", "bf16"}):
        assert resolve_dtype("native", str(TINY_MODEL), on_cpu=True, flags=flags) == ("auto", None)
    # accelerators compute their model's dtype: vLLM's auto
    assert resolve_dtype("native", str(TINY_MODEL), on_cpu=False, flags=AVX2_ONLY) == ("auto", None)


def test_native_picks_float32_where_the_cpu_would_emulate_bfloat16():
    dtype, note = resolve_dtype("native", str(TINY_MODEL), on_cpu=True, flags=AVX2_ONLY)
    assert dtype == "float32" and "bfloat16" in note and "avx512_bf16" in note


def test_an_explicit_half_dtype_is_kept_with_a_warning_naming_native():
    for asked in ("bfloat16", "auto"):  # auto: vLLM would take the model's bfloat16
        dtype, warning = resolve_dtype(asked, str(TINY_MODEL), on_cpu=True, flags=AVX2_ONLY)
        assert dtype == asked and "native" in warning and "emulates" in warning
    assert resolve_dtype("float16", str(TINY_MODEL), on_cpu=True, flags={"avx512_fp16"}) == ("float16", None)
    assert resolve_dtype("float32", str(TINY_MODEL), on_cpu=True, flags=AVX2_ONLY) == ("float32", None)


def test_a_model_of_unknown_dtype_is_left_to_vllm(tmp_path):
    # a hub id (no local config.json) or a config without a dtype: vLLM's auto decides
    for model in ("org/some-model", str(tmp_path)):
        assert model_dtype(model) is None
        assert resolve_dtype("native", model, on_cpu=True, flags=AVX2_ONLY) == ("auto", None)


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t: other\n"
    )
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "fma"}
    assert cpu_flags(str(arm)) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
