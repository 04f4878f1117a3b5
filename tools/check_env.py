"""Check that the installed environment imports what pdcluster uses (run by `make` after install).

Exits non-zero with one line per problem. Also run by tests/unit/test_environment.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys

# Modules the code imports, and why.
REQUIRED = [
    "vllm",
    "torch",
    "transformers",
    "transformers.models.qwen2",
    "ray",
    "grpc",
    "google.protobuf",
    "pydantic",
    "yaml",
    "fastapi",
    "uvicorn",
    "httpx",
    "prometheus_client",
    "tokenizers",
    "safetensors",
    "openai",
    "pytest",
    "hypothesis",
    "matplotlib",
    "psutil",
    "pdcluster",
]
# Installed beside torch+cpu, these break `transformers` imports (torchvision::nms missing).
FORBIDDEN = ["torchvision", "torchaudio", "torchcodec"]


def problems() -> list[str]:
    found = []
    for name in FORBIDDEN:
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            continue
        found.append(f"{name} {version} is installed and breaks transformers with torch+cpu")
    for module in REQUIRED:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - report any import failure, that is the check
            found.append(f"cannot import {module}: {type(exc).__name__}: {exc}")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(f"check_env: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
