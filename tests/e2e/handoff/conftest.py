"""`engines` (package): the aggregated reference (tests/e2e/conftest.py) and the prefill and
decode engines of common.engine_specs, started once for every module of the package."""

from __future__ import annotations

import pytest

from tests.e2e.handoff.common import engine_specs
from tests.support.engines import run_engines


@pytest.fixture(scope="package")
def engines(tmp_path_factory, reference_engine):
    tmp = tmp_path_factory.mktemp("kv-handoff")
    secret = tmp / "secret"
    secret.write_text("handoff-test-secret\n")
    with run_engines(engine_specs(secret), tmp) as running:
        yield {"agg": reference_engine, **running}
