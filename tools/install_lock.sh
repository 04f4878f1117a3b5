#!/usr/bin/env bash
# Install a lock file (requirements/cpu.lock) into a virtual environment: what `make setup` runs.
# With uv where it can be had: uv downloads, unpacks and compiles the bytecode on every core (on a
# 2-core VM ~45 s, where pip took ~3 min, most of it compiling one file at a time). uv is told
# pip's own settings (`pip config list`: indexes, find-links, constraints, trusted hosts, the
# certificate), so both install from the same places. Where uv cannot be installed, or fails, or
# PIP_EXTRA holds pip flags, pip installs it; where that fails, pip again with PyTorch's CPU index
# (torch +cpu is not on PyPI). The bytecode is compiled either way: a Python that writes none
# (PYTHONDONTWRITEBYTECODE) would otherwise compile torch and vLLM on every import.
#   usage: tools/install_lock.sh PYTHON LOCK     (PYTHON: the venv's interpreter)
set -euo pipefail
py=$1 lock=$2
UV_VERSION=0.13.9
TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pip warns for each configured local index folder lacking a package: noise, not a problem.
NOISE="is ignored: it is neither a file nor a directory"

# pip, its warnings about configured local index folders lacking a package left out (its exit
# status kept: pipefail).
quiet_pip() { "$py" -m pip "$@" 2>&1 | { grep -v "$NOISE" || true; }; }

truthy() { case ${1,,} in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac }

# UV_FLAGS and CERT: pip's configured settings as uv's flags (each setting's value split on spaces,
# as pip splits it) and its certificate bundle.
read_pip_config() {
  local line key value v
  UV_FLAGS=() CERT=""
  while IFS= read -r line; do
    key=${line%%=*} value=${line#*=}
    key=${key##*.} value=${value#\'} value=${value%\'}
    case $key in
      index-url) UV_FLAGS+=("--index-url=$value") ;;
      extra-index-url) for v in $value; do UV_FLAGS+=("--extra-index-url=$v"); done ;;
      find-links) for v in $value; do UV_FLAGS+=("--find-links=$v"); done ;;
      constraint) for v in $value; do UV_FLAGS+=("--constraints=$v"); done ;;
      trusted-host) for v in $value; do UV_FLAGS+=("--allow-insecure-host=$v"); done ;;
      no-index) if truthy "$value"; then UV_FLAGS+=("--no-index"); fi ;;
      cert) CERT=$value ;;
    esac
  done < <("$py" -m pip config list 2>/dev/null)
}

with_uv() {
  [ -z "${PIP_EXTRA:-}" ] || return 1
  quiet_pip install -q "uv==$UV_VERSION"
  local uv=${py%/*}/uv
  [ -x "$uv" ] || return 1
  read_pip_config
  if [ -n "$CERT" ]; then export SSL_CERT_FILE=$CERT; fi
  # pip weighs every index alike; uv's default takes a package from the first index that has it.
  "$uv" pip install -q --python "$py" --no-deps --compile-bytecode \
    --index-strategy unsafe-best-match "${UV_FLAGS[@]}" -r "$lock"
}

with_pip() {
  # shellcheck disable=SC2086 # PIP_EXTRA is a list of flags
  quiet_pip install -q --no-deps ${PIP_EXTRA:-} "$@" -r "$lock"
}

if with_uv; then
  echo "install_lock: installed $lock with uv $UV_VERSION"
  exit 0
fi
echo "install_lock: installing $lock with pip (~3 min)"
with_pip || {
  echo "install_lock: retrying with PyTorch's CPU index (torch +cpu is not on PyPI)"
  with_pip --extra-index-url "$TORCH_INDEX"
}
echo "install_lock: installed $lock with pip"
