"""Prompts for tests: held-out code from the tiny model's card, cut to exact token lengths."""

from __future__ import annotations

import functools
import json
import threading

from tests.support.engines import MODEL


@functools.lru_cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


@functools.lru_cache
def heldout_prompts() -> tuple[str, ...]:
    lines = (MODEL / "heldout_prompts.jsonl").read_text().splitlines()
    return tuple(json.loads(line)["prompt"] for line in lines)


# Client threads ask for their first prompt at once: the first tokenization (transformers' lazy
# import, not thread-safe: "cannot import name 'AutoTokenizer'") runs in one of them only.
_FIRST_USE = threading.Lock()


@functools.lru_cache
def _heldout_token_stream() -> tuple[int, ...]:
    with _FIRST_USE:
        ids: list[int] = []
        for text in heldout_prompts():
            ids.extend(tokenizer()(text)["input_ids"])
        return tuple(ids)


def token_prompt(length: int, offset: int = 0) -> list[int]:
    """`length` token ids of real held-out code, starting `offset` tokens into the stream."""
    stream = _heldout_token_stream()
    reps = (offset + length) // len(stream) + 1
    longer = stream * reps
    return list(longer[offset : offset + length])
