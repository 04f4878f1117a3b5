"""vLLM's rejection sampler (speculative decoding) on CPU: sampled requests.

With MTP (or any drafter) a sampled request -- temperature > 0, top_k, top_p -- has its draft
tokens judged by `vllm.v1.sample.rejection_sampler`, which first spreads each request's
temperature, top_k and top_p over its draft tokens (`expand_batch_to_tokens`). On CPU that
spreading is broken in the vLLM we run, and greedy requests never reach it, so the fault shows
only with sampling:
  - the Triton kernel behind it (`expand_kernel`) is replaced on CPU by a C++ fallback
    (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that hands the kernel an int64 *copy* of
    the output buffer and never copies it back, and truncates float inputs to int64: the buffer
    comes back uninitialized, so draft tokens are judged at garbage temperatures, top_k and top_p
    (a wrong distribution, silently) or the engine core dies on an out-of-range index;
  - in a step where no request has drafts, a request with top_k alone reaches the sort-free top-k
    (`topk_topp_sampler.apply_top_k_only`) with zero rows, whose `k.max()` raises: the engine
    core dies (EngineDeadError for every request on the engine).
`fix_cpu_spec_sampling` puts right both, in the processes pdcluster starts (vllm_plugin.py).
"""

from __future__ import annotations

import functools
import importlib

import torch

from pdcluster.compat.guard import expect_parameters, resolve

REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"
FIXED = "_pdcluster_cpu_fix"  # marks the functions this module installed


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """What the Triton kernel computes: x[i] repeated for request i's tokens (their counts are
    the steps of cu_num_tokens), values equal to replace_from replaced by replace_to."""
    values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype, device=x.device), x)
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def _check() -> tuple[object, object]:
    expand = resolve(REJECTION_SAMPLER, "expand_batch_to_tokens")
    expect_parameters(
        expand,
        f"{REJECTION_SAMPLER}.expand_batch_to_tokens",
        ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"],
    )
    constraints = resolve(REJECTION_SAMPLER, "apply_sampling_constraints")
    expect_parameters(
        constraints,
        f"{REJECTION_SAMPLER}.apply_sampling_constraints",
        ["logits", "cu_num_draft_tokens", "sampling_metadata"],
    )
    return expand, constraints


def check_spec_sampling() -> None:
    """The shape check of fix_cpu_spec_sampling (patches nothing)."""
    _check()


def fix_cpu_spec_sampling() -> bool:
    """Replace, on CPU, `rejection_sampler.expand_batch_to_tokens` by the torch computation above
    and make `rejection_sampler.apply_sampling_constraints` return draft-less (zero-row) logits
    as they are. Upstream: both module functions (RejectionSampler.forward calls the second by
    its module-global name, which calls the first the same way). Idempotent; False where the
    platform is not CPU (its Triton kernels run as written) or it was done already."""
    from pdcluster.compat.vllm_frontend import platform_device

    if not platform_device()[1]:
        return False
    expand, constraints = _check()
    if getattr(expand, FIXED, False) and getattr(constraints, FIXED, False):
        return False
    module = importlib.import_module(REJECTION_SAMPLER)

    @functools.wraps(constraints)
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata, *args, **kwargs):
        if logits.shape[0] == 0:  # no draft token in this step: nothing to constrain
            return logits
        return constraints(logits, cu_num_draft_tokens, sampling_metadata, *args, **kwargs)

    setattr(apply_sampling_constraints, FIXED, True)
    setattr(expand_batch_to_tokens, FIXED, True)
    module.expand_batch_to_tokens = expand_batch_to_tokens
    module.apply_sampling_constraints = apply_sampling_constraints
    return True
