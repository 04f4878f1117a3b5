"""The shipped tiny model's files: its architecture, MTP head and size. That it loads in vLLM in
its own dtype, generates code-like text and has its MTP drafts accepted is tested on
test_bf16_identity.py's engine (test_the_shipped_model_generates_code_and_its_mtp_is_accepted)."""

from __future__ import annotations

import json

import pytest

from tests.support.engines import MODEL
from tests.support.prompts import heldout_prompts

pytestmark = pytest.mark.e2e


def test_shipped_model_files():
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert (MODEL / "model.safetensors").stat().st_size <= 25 * 2**20
    from safetensors import safe_open

    with safe_open(MODEL / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys
    assert any(k.startswith("model.mtp_layers.0.") for k in keys)
    assert len(heldout_prompts()) == 50
