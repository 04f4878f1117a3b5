"""The greedy-identity check the e2e tests use (tests/support/identity.py): what it accepts and
what it refuses, on hand-made outputs."""

from __future__ import annotations

import math

import pytest

from tests.support.identity import Greedy, assert_same_greedy, compare

REFERENCE = Greedy(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.5, -0.9, -0.2], gaps=[2.0, 1.0, 0.05, 3.0])


def other(ids, logprobs):
    return Greedy(ids, logprobs, gaps=[math.inf] * len(ids))


def test_identical_passes_in_both_dtypes():
    for dtype in ("float32", "bfloat16"):
        verdict = assert_same_greedy(REFERENCE, other([5, 6, 7, 8], [-0.1, -0.5, -0.9, -0.2]), dtype)
        assert verdict.divergence_gap is None and verdict.max_drift == 0


def test_float32_refuses_bf16_sized_drift_that_bf16_accepts():
    drifted = other([5, 6, 7, 8], [-0.1, -0.53, -0.9, -0.2])
    assert_same_greedy(REFERENCE, drifted, "bfloat16")
    with pytest.raises(AssertionError, match="drift 3.000e-02 exceeds the float32 bound"):
        assert_same_greedy(REFERENCE, drifted, "float32")


def test_a_flip_passes_only_as_a_near_tie(capsys):
    # token 2 flips where the reference's margin is 0.05: a bf16 near-tie, printed
    flipped = other([5, 6, 9, 9], [-0.1, -0.52, -0.95, -1.0])
    verdict = assert_same_greedy(REFERENCE, flipped, "bfloat16")
    assert (verdict.matched, verdict.divergence_gap) == (2, 0.05)
    assert "tolerated bfloat16 near-tie: diverged at token 2 of 4" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="not a near-tie"):  # float32 margins are tighter
        assert_same_greedy(REFERENCE, other([5, 6, 9, 9], [-0.1, -0.5, -0.95, -1.0]), "float32")
    # token 1 flips where the margin is 1.0: never a near-tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_greedy(REFERENCE, other([5, 9, 9, 9], [-0.1, -1.5, -1, -1]), "bfloat16")


def test_large_drift_before_a_flip_fails_even_at_a_tie():
    with pytest.raises(AssertionError, match="exceeds the bfloat16 bound"):
        assert_same_greedy(REFERENCE, other([5, 6, 9, 9], [-1.1, -0.5, -1, -1]), "bfloat16")


def test_fewer_tokens_fails():
    with pytest.raises(AssertionError, match="3 tokens vs the reference's 4"):
        assert_same_greedy(REFERENCE, other([5, 6, 7], [-0.1, -0.5, -0.9]), "float32")
    assert compare(REFERENCE, other([5, 6, 7], [-0.1, -0.5, -0.9])).matched == 3


def test_from_choice_reads_vllm_logprobs():
    choice = {
        "token_ids": [3, 4],
        "logprobs": {
            "token_logprobs": [-0.25, -1.0],
            "top_logprobs": [{"token_id:3": -0.25, "token_id:9": -1.75}, {"token_id:4": -1.0}],
        },
    }
    greedy = Greedy.from_choice(choice)
    assert greedy.token_ids == [3, 4] and greedy.logprobs == [-0.25, -1.0]
    assert greedy.gaps == [1.5, math.inf]
