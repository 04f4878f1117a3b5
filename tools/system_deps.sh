#!/usr/bin/env bash
# System packages the tests and multi-node features use, installed when missing (Debian/Ubuntu,
# as root: CI and the dev machines); elsewhere the exact command to run is printed and the tests
# that need them skip with that reason.
#   nft (nftables)          network faults between test hosts (tests/support/netfaults.py)
#   ip, nsenter, unshare    test hosts (tests/support/hosts.py)
set -euo pipefail

declare -A PACKAGE=([nft]=nftables [ip]=iproute2 [nsenter]=util-linux [unshare]=util-linux)
missing=()
for command in "${!PACKAGE[@]}"; do
  command -v "$command" >/dev/null 2>&1 || missing+=("${PACKAGE[$command]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing system packages: $packages"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $packages >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $packages >/dev/null; }
else
  echo "pdcluster: missing system packages ($packages); run: sudo apt-get install -y $packages" >&2
fi
