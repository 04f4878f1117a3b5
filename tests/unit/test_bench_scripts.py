"""Every benchmark script imports against the current code (a bench is run by hand, seldom: a
name it imports that was renamed would otherwise surface only then)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_bench_script_imports(name):
    module = importlib.import_module(f"bench.{name}")
    assert module.__doc__  # each says what it measures and how
