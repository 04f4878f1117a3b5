#!/usr/bin/env bash
# The virtual environment `make setup` installs into: made with CPython 3.11 (the lock's wheels
# are built for it), else one line saying what to do. (Debian's python3.11 needs python3.11-venv
# for `-m venv`: tools/system_deps.sh, which make runs first, installs it or says how.)
#   usage: tools/make_venv.sh PYTHON VENV
set -euo pipefail
python=$1 venv=$2
if ! version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
  echo "pdcluster: no Python at '$python'; install CPython 3.11 or run: make PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ "$version" != "3.11" ]; then
  echo "pdcluster: needs CPython 3.11 (the lock's wheels), '$python' is $version; run: make PYTHON=/path/to/python3.11" >&2
  exit 1
fi
"$python" -m venv "$venv"
