# pdcluster — two commands: `make run` and `make test` (both set up .venv first if needed).
SHELL := /bin/bash
# CPython 3.11: the lock's wheels are built for it (python3.11 where that name exists)
PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements/cpu.lock
CONFIG ?= configs/local-cpu.yaml
# Extra pip flags (set: the lock is installed with pip, not uv; tools/install_lock.sh).
PIP_EXTRA ?=

.PHONY: setup system run test test-unit test-e2e lint format protos clean

setup: system $(STAMP)

# System packages (apt) the tests use: installed when missing and possible (tools/system_deps.sh).
system:
	@PYTHON="$(PYTHON)" VENV="$(VENV)" tools/system_deps.sh

$(STAMP): $(LOCK) pyproject.toml | system
	@test -x $(PY) || tools/make_venv.sh "$(PYTHON)" $(VENV)
	@echo "Installing pinned environment into $(VENV) (first run only, ~1 min with uv, ~3 with pip)..."
	@PIP_EXTRA="$(PIP_EXTRA)" tools/install_lock.sh $(PY) $(LOCK)
	@set -o pipefail; $(PY) -m pip install -q --no-deps --no-build-isolation -e . 2>&1 \
	  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	@$(PY) tools/check_env.py
	@touch $(STAMP)

run: system $(STAMP)
	@$(VENV)/bin/pdcluster up $(CONFIG) --foreground

# The lint (ruff: style, imports, common bugs, formatting) runs first: a tree it refuses fails.
lint: $(STAMP)
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check --quiet .

# Apply the formatter and the lint's safe fixes to the tree.
format: $(STAMP)
	@$(VENV)/bin/ruff format --quiet . && $(VENV)/bin/ruff check --fix --quiet .

# Two pytest sessions at once, the Ray-cluster modules in one lane (tools/test_lanes.py).
test: system lint
	@$(PY) tools/test_lanes.py

test-unit: $(STAMP)
	@$(PY) -m pytest -q tests/unit

test-e2e: $(STAMP)
	@$(PY) -m pytest -q -m e2e tests

# Regenerate the committed gRPC stubs (tests/unit/test_protos.py checks they are current).
protos: $(STAMP)
	@$(PY) tools/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache
