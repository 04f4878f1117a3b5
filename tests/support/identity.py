"""Greedy identity between two engines' outputs, strict where the arithmetic allows it.

P/D and one aggregated engine compute the same function in a different order (decode recomputes
the prompt's last position over loaded KV, batches differ), so their logits differ by rounding:
~1e-6 in float32, ~1e-2 in bfloat16. In bfloat16 that is enough to flip a near-tie, and which
near-ties flip depends on the CPU's kernels (../shared/notes/numerics.md): an exact-token test in
bf16 passes on one machine and fails on the next.

So identity is judged on tokens *and* their logprobs, with a tolerance per dtype:
- every token before the first divergence must carry the reference's logprob within `drift`;
- a divergence passes only as a diagnosed near-tie: the reference's top-1 minus top-2 logprob
  at that position is within `gap`, and the drift before it was within `drift`.
Corrupt KV shows as logprob deviations far above either bound long before a token flips. The
float32 bounds are tight (strict identity); the bfloat16 ones tolerate rounding-order near-ties
only. Both numbers of a tolerated divergence are printed, so every pass says what it accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TOP_LOGPROBS = 2  # what requests ask for: the chosen token's rank-1 competitor gives the gap


@dataclass(frozen=True)
class Tolerance:
    drift: float  # largest |logprob(reference) - logprob(other)| of an agreed token
    gap: float  # largest reference top-1 minus top-2 logprob at which a flip is a near-tie


TOLERANCES = {
    "float32": Tolerance(drift=1e-3, gap=1e-3),
    "bfloat16": Tolerance(drift=0.15, gap=0.15),
}


@dataclass(frozen=True)
class Greedy:
    """One choice of a greedy completion: its tokens, their logprobs, and the reference's margin
    (top-1 minus top-2 logprob) at each position."""

    token_ids: list[int]
    logprobs: list[float]
    gaps: list[float]

    @classmethod
    def from_choice(cls, choice: dict[str, Any]) -> Greedy:
        """From a /v1/completions choice asked with `logprobs: 2, return_token_ids: true,
        return_tokens_as_token_ids: true` (so top-logprob keys are ids and never collide)."""
        ids = [int(t) for t in choice["token_ids"]]
        lp = choice.get("logprobs")
        if not lp:
            raise AssertionError("completion has no logprobs: ask with identity_fields()")
        chosen = [float(x) for x in lp["token_logprobs"]]
        gaps = []
        for top in lp["top_logprobs"]:
            values = sorted((float(v) for v in (top or {}).values()), reverse=True)
            gaps.append(values[0] - values[1] if len(values) > 1 else math.inf)
        if not (len(ids) == len(chosen) == len(gaps)):
            raise AssertionError(f"logprobs cover {len(chosen)} of {len(ids)} tokens")
        return cls(ids, chosen, gaps)


def identity_fields() -> dict[str, Any]:
    """Request fields that make a completion carry what `Greedy.from_choice` reads."""
    return {"logprobs": TOP_LOGPROBS, "return_token_ids": True, "return_tokens_as_token_ids": True}


def greedy_completion(http, prompt, max_tokens: int, model: str = "tiny", headers: dict | None = None) -> Greedy:
    """A greedy /v1/completions answer of `http` (an httpx.Client on an engine or the router),
    with what identity is judged on."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **identity_fields()}
    response = http.post("/v1/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return Greedy.from_choice(response.json()["choices"][0])


@dataclass(frozen=True)
class Verdict:
    matched: int  # leading tokens equal
    total: int
    max_drift: float  # over the matched tokens
    divergence_gap: float | None  # reference margin at the first differing token, if any

    def describe(self) -> str:
        if self.divergence_gap is None:
            return f"identical {self.total} tokens, max logprob drift {self.max_drift:.2e}"
        return (
            f"diverged at token {self.matched} of {self.total}: reference top-1 minus top-2 "
            f"{self.divergence_gap:.4f}, max logprob drift before it {self.max_drift:.2e}"
        )


def compare(reference: Greedy, other: Greedy) -> Verdict:
    total = min(len(reference.token_ids), len(other.token_ids))
    matched = 0
    while matched < total and reference.token_ids[matched] == other.token_ids[matched]:
        matched += 1
    drifts = [abs(reference.logprobs[i] - other.logprobs[i]) for i in range(matched)]
    gap = reference.gaps[matched] if matched < total else None
    return Verdict(matched, total, max(drifts, default=0.0), gap)


def assert_same_greedy(reference: Greedy, other: Greedy, dtype: str, what: str = "") -> Verdict:
    """Fail unless `other` equals `reference` within the dtype's tolerance (module docstring);
    a tolerated near-tie is printed with its numbers."""
    tol = TOLERANCES[dtype]
    verdict = compare(reference, other)
    label = f"{what}: " if what else ""
    if len(reference.token_ids) != len(other.token_ids) and verdict.divergence_gap is None:
        raise AssertionError(f"{label}{len(other.token_ids)} tokens vs the reference's {len(reference.token_ids)}")
    if verdict.max_drift > tol.drift:
        raise AssertionError(
            f"{label}logprob drift {verdict.max_drift:.3e} exceeds the {dtype} bound "
            f"{tol.drift:g} ({verdict.describe()}): the KV or the computation differs"
        )
    if verdict.divergence_gap is not None:
        if verdict.divergence_gap > tol.gap:
            raise AssertionError(f"{label}{verdict.describe()}; not a near-tie (bound {tol.gap:g} for {dtype})")
        print(f"{label}tolerated {dtype} near-tie: {verdict.describe()}")
    return verdict
