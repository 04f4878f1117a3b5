"""The tests' prompt helper from many client threads at once (as test_planner's flood starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FIRST_USE_FROM_THREADS = """
from concurrent.futures import ThreadPoolExecutor
from tests.support.prompts import token_prompt
with ThreadPoolExecutor(8) as pool:
    print(sorted(set(pool.map(lambda i: len(token_prompt(300, offset=7919 * i)), range(8)))))
"""


def test_the_first_prompts_asked_from_many_threads_at_once_all_come_back():
    # A fresh process: the first tokenization (transformers' lazy import) is what raced.
    result = subprocess.run(
        [sys.executable, "-c", FIRST_USE_FROM_THREADS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[300]"
