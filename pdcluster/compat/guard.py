"""The version check, the process gate, and the shape-check helpers every reach uses.

`require_tested_vllm` runs once per process before any vLLM reach; `is_pdcluster_engine_process`
is the gate for process-level patches (the marker EngineSpec.env() sets for every engine).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

TESTED_VLLM = frozenset({"0.32.0"})
ALLOW_UNTESTED_ENV = "PDCLUSTER_ALLOW_UNTESTED_VLLM"
ENGINE_MARKER_ENV = "PDCLUSTER_ENGINE"  # "1" in every engine process pdcluster starts


class UntestedVLLMError(RuntimeError):
    """The installed vLLM is not one pdcluster was tested with."""


class VLLMShapeError(RuntimeError):
    """An upstream symbol pdcluster reaches differs from the one it was written against."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> str:
    """Raise UntestedVLLMError unless `version` (default: the installed vLLM) is tested.

    A local version label is ignored ("0.32.0+cpu" is the CPU build of 0.32.0). With
    PDCLUSTER_ALLOW_UNTESTED_VLLM=1 an untested version is logged as a warning instead."""
    found = installed_vllm_version() if version is None else version
    if found.split("+", 1)[0] in TESTED_VLLM:
        return found
    message = (
        f"pdcluster is tested with vLLM {', '.join(sorted(TESTED_VLLM))}, this environment has "
        f"vLLM {found}: the vLLM internals pdcluster relies on (pdcluster/compat/) may differ. "
        f"Install a tested vLLM, or set {ALLOW_UNTESTED_ENV}=1 to run anyway (each reach still "
        "checks its symbol's shape)."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s", message)
        return found
    raise UntestedVLLMError(message)


@functools.cache
def require_tested_vllm() -> str:
    """check_vllm_version() for the installed vLLM, once per process."""
    return check_vllm_version()


def is_pdcluster_engine_process() -> bool:
    """Whether pdcluster started this process (or its parent) for an engine (EngineSpec.env())."""
    return os.environ.get(ENGINE_MARKER_ENV) == "1"


def resolve(module: str, qualname: str, *, vllm: bool = True) -> Any:
    """`module.qualname`, or VLLMShapeError naming it; vLLM symbols only on a tested vLLM."""
    if vllm:
        require_tested_vllm()
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise VLLMShapeError(f"{module} cannot be imported: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise VLLMShapeError(f"{module}.{qualname} is missing") from None
    return obj


def expect_parameters(func: Callable, symbol: str, expected: Sequence[str]) -> None:
    """VLLMShapeError unless `func`'s parameters begin with `expected` (by name, in order)."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        raise VLLMShapeError(f"{symbol}: no readable signature ({exc})") from exc
    if names[: len(expected)] != list(expected):
        raise VLLMShapeError(f"{symbol}: expected parameters {list(expected)}, found {names}")


def expect_attributes(obj: Any, symbol: str, names: Sequence[str]) -> None:
    """VLLMShapeError unless `obj` has every attribute in `names`."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise VLLMShapeError(f"{symbol}: missing {missing}")
