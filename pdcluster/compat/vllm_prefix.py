"""vLLM's prefix-cache block hashing, for the router's cache-aware matching
(orchestrator/router/cache_index.py).

A router that asks "how many leading blocks of this prompt does replica r hold?" must hash the
prompt's tokens exactly as the engine's scheduler does, so that its hashes equal the ones the
engine's KV cache events carry (engine/kv_events.py). vLLM promises neither the function nor its
seed handling, so both are reached here, named and shape-checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdcluster.compat.guard import VLLMShapeError, expect_parameters, resolve

KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
LOW_64_BITS = (1 << 64) - 1


def external_hash(value: bytes | int) -> int:
    """A block hash as KV events carry it: the low 64 bits as an int (vLLM's
    `maybe_convert_block_hash` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default); bytes
    hashes (that setting off) are brought to the same form."""
    if isinstance(value, int):
        return value & LOW_64_BITS
    return int.from_bytes(value, "big") & LOW_64_BITS


def block_hasher(algo: str) -> Callable[..., list[int]]:
    """`hash_prompt(token_ids, block_size, cache_salt=None)`: the external hashes of the prompt's
    full blocks, in order, as an engine using prefix_caching_hash_algo `algo` computes them.

    Upstream: `kv_cache_utils.hash_block_tokens(hash_function, parent_block_hash,
    curr_block_token_ids, extra_keys)` (the chained block hash), `resolve_none_hash_seed` (the
    first block's parent: a fixed seed for cryptographic algorithms, PYTHONHASHSEED when set,
    random per process for xxhash) and `vllm.utils.hashing.get_hash_fn_by_name`. Why: the hashes
    must be the engine's own. The first block's parent is passed explicitly, so this process's
    `NONE_HASH` global is neither read nor set. A request's cache_salt is the first block's extra
    key, as `generate_block_hash_extra_keys` adds it (`("cache_salt", salt)`, first block only).
    The router computes ids only for prompts without LoRA, multimodal inputs or prompt embeddings
    (the other extra keys)."""
    hash_tokens = resolve(KV_CACHE_UTILS, "hash_block_tokens")
    expect_parameters(
        hash_tokens,
        f"{KV_CACHE_UTILS}.hash_block_tokens",
        ["hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"],
    )
    seed_of = resolve(KV_CACHE_UTILS, "resolve_none_hash_seed")
    expect_parameters(seed_of, f"{KV_CACHE_UTILS}.resolve_none_hash_seed", ["hash_fn"])
    hash_fn: Callable[[Any], bytes] = resolve("vllm.utils.hashing", "get_hash_fn_by_name")(algo)
    root = hash_fn(seed_of(hash_fn))

    def hash_prompt(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
        hashes, parent = [], root
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = hash_tokens(hash_fn, parent, token_ids[start : start + block_size], extra)
            hashes.append(external_hash(parent))
        return hashes

    return hash_prompt


def drops_last_cached_block(vllm_config: Any) -> bool:
    """Whether the engine recomputes the last block of every prefix-cache hit.

    Upstream: `SpeculativeConfig.use_eagle_block_drop()`, read by the scheduler's KV cache
    coordinator, which drops the last matched block for EAGLE-style drafters (MTP included) so
    the drafter gets that block's hidden states. Why: a router predicting an engine's hit must
    take the same block off."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    drop = getattr(spec, "use_eagle_block_drop", None)
    if drop is None:
        raise VLLMShapeError("vllm.config.SpeculativeConfig.use_eagle_block_drop is missing")
    return bool(drop())


def check_block_hasher() -> None:
    """Shape check: the reach resolves for vLLM's default algorithm and chains blocks."""
    hashes = block_hasher("sha256")(list(range(8)), 4)
    if len(hashes) != 2 or hashes[0] == hashes[1]:
        raise VLLMShapeError(
            f"{KV_CACHE_UTILS}.hash_block_tokens: vLLM's block hashing no longer chains blocks as expected"
        )
