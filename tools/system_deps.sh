#!/usr/bin/env bash
# System packages pdcluster and its tests need (Debian/Ubuntu), installed when missing and this
# runs as root (CI and the dev machines); otherwise the exact command to run is printed.
#   required   libibverbs1, librdmacm1   Mooncake's transfer engine links them, also for TCP
#                                        (the `mooncake` KV backend); setup stops without them
#              python3.11-venv           where $PYTHON (make's) is a 3.11 that cannot make the venv
#                                        yet to be made (Debian's python3.11 without it; another
#                                        Python: tools/make_venv.sh says what to do)
#   tests      nft (nftables)            network faults between test hosts (tests/support/netfaults.py)
#              ip, nsenter, unshare      test hosts (tests/support/hosts.py); tests skip without them
set -euo pipefail

declare -A LIBRARY=([libibverbs.so.1]=libibverbs1 [librdmacm.so.1]=librdmacm1)
declare -A COMMAND=([nft]=nftables [ip]=iproute2 [nsenter]=util-linux [unshare]=util-linux)
required=()
optional=()
# ldconfig is in /sbin, which a user's PATH may lack (Debian): a library it cannot list is missing
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
for library in "${!LIBRARY[@]}"; do
  "$ldconfig" -p 2>/dev/null | grep -q "$library" || required+=("${LIBRARY[$library]}")
done
python=${PYTHON:-python3}  # make's, for the venv it has yet to make (VENV)
if [ ! -x "${VENV:-.venv}/bin/python" ] && command -v "$python" >/dev/null 2>&1 \
  && "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
  && ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  required+=(python3.11-venv)
fi
for command in "${!COMMAND[@]}"; do  # (ip and nft live in /sbin or /usr/sbin)
  command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ] || [ -x "/sbin/$command" ] \
    || optional+=("${COMMAND[$command]}")
done
missing=$(printf '%s\n' "${required[@]}" "${optional[@]}" | grep -v '^$' | sort -u | tr '\n' ' ' || true)
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing system packages: $missing"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null; }
  exit 0
fi
if [ ${#required[@]} -gt 0 ]; then
  echo "pdcluster: missing system packages; run: sudo apt-get install -y $missing" >&2
  exit 1
fi
echo "pdcluster: missing system packages for some tests (they skip); run: sudo apt-get install -y $missing" >&2
