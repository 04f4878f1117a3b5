"""pdcluster.compat: the one place pdcluster reaches into vLLM (and torch) internals.

A vLLM pdcluster was not tested with is refused by name; every reach fits the installed vLLM;
and the process-level patches reach only processes pdcluster launched: real subprocesses load
vLLM's general plugins the way every vLLM process does and report what they got.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from pdcluster import compat
from pdcluster.compat import (
    ALLOW_UNTESTED_ENV,
    ENGINE_MARKER_ENV,
    TESTED_VLLM,
    UntestedVLLMError,
    VLLMShapeError,
    check_vllm_version,
    shape_checks,
)
from pdcluster.engine.spec import EngineSpec
from pdcluster.vllm_plugin import AMX_PLUGIN, IDLE_RECHECK_MS, WORKER_SPIN_ENV


def test_an_untested_vllm_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedVLLMError) as refused:
        check_vllm_version("0.33.0")
    message = str(refused.value)
    assert "vLLM 0.33.0" in message and all(v in message for v in TESTED_VLLM)
    assert ALLOW_UNTESTED_ENV in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_a_tested_vllm_passes_whatever_its_build_label(version):
    assert check_vllm_version(version) == version


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(logging.getLogger("pdcluster"), "propagate", True)  # setup_logging may have cut it
    with caplog.at_level(logging.WARNING, logger="pdcluster.compat"):
        assert check_vllm_version("0.31.1") == "0.31.1"
    assert "vLLM 0.31.1" in caplog.text


def test_the_installed_vllm_is_a_tested_one():
    check_vllm_version()


@pytest.mark.parametrize("reach", sorted(shape_checks()))
def test_every_reach_fits_the_installed_vllm(reach):
    shape_checks()[reach]()


def test_a_symbol_that_is_gone_fails_loudly_by_name():
    with pytest.raises(VLLMShapeError, match=r"vllm\.v1\.request\.Request\._no_such_field is missing"):
        compat.guard.resolve("vllm.v1.request", "Request._no_such_field")


def test_every_engine_pdcluster_starts_carries_the_marker():
    spec = EngineSpec(role="aggregated", engine_id="e", model="m", extra_env={ENGINE_MARKER_ENV: "0"})
    assert spec.env()[ENGINE_MARKER_ENV] == "1"


# A vLLM worker process, as far as our plugin can tell: it loads vLLM's general plugins (as
# vLLM does in every process it starts), then reports what they did to vLLM's step queues.
# One interpreter imports torch and vLLM's modules once, then forks a child per case; each
# child takes its case's environment, loads the plugins and reports (a line per case).
PROBE = """
import io, json, logging, multiprocessing, multiprocessing.synchronize, os, sys
import torch
import tqdm
from vllm.plugins import load_general_plugins
from vllm.v1.sample import rejection_sampler
from pdcluster import compat, vllm_plugin
for case, env in enumerate(json.loads(sys.argv[1])):
    pid = os.fork()
    if pid:
        assert os.waitpid(pid, 0)[1] == 0, env
        continue
    os.environ.update(env)
    multiprocessing.current_process().name = "VllmWorker-0"
    load_general_plugins()
    spin, recheck_ms = compat.queue_reader_spin()
    from vllm.platforms import current_platform
    current_platform.register_triton_kernel_overrides()  # as a CPU worker does after the plugins
    # requests' temperatures (0: greedy, made 1) over their draft tokens: 2, 0 and 3 of them
    spread = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.0, 0.75, 0.5]), torch.tensor([2, 2, 5], dtype=torch.int32), 5, 0, 1
    ).tolist()
    # the first progress bar of the process (vLLM's weight loading is one): the semaphores made for
    # it, each a /dev/shm file in a spawned process such as an engine core
    made = []
    semlock_init = multiprocessing.synchronize.SemLock.__init__
    multiprocessing.synchronize.SemLock.__init__ = lambda *a, **k: made.append(1) or semlock_init(*a, **k)
    for _ in tqdm.tqdm(range(2), file=io.StringIO()):
        pass
    print(json.dumps({"case": case, "report": {
        "spin_s": spin, "recheck_ms": recheck_ms, "pings_kept": compat.queue_pings_kept(),
        "pdcluster_logging": bool(logging.getLogger("pdcluster").handlers),
        "amx_asked": vllm_plugin._amx_requested is not None,
        "drafts_sampled_right": spread == [1.0, 1.0, 0.5, 0.5, 0.5],
        "bar_semaphores": len(made),
    }}), flush=True)
    os._exit(0)
"""

# The probe's cases: the environment each child adds to the probe's own.
CASES = {
    "stock": {},
    "launched": {ENGINE_MARKER_ENV: "1"},
    "amx alone": {"VLLM_PLUGINS": AMX_PLUGIN},
    "amx alone, marked": {"VLLM_PLUGINS": AMX_PLUGIN, ENGINE_MARKER_ENV: "1"},
}


@pytest.fixture(scope="module")
def probed() -> dict[str, dict]:
    """What each case's process got from vLLM's general plugins, by case name. The probe starts
    without the marker and VLLM_PLUGINS, with the worker spin a role's default sets."""
    base = {k: v for k, v in os.environ.items() if k not in (ENGINE_MARKER_ENV, "VLLM_PLUGINS")}
    base[WORKER_SPIN_ENV] = "5"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(CASES.values()))],
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = list(CASES)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"case"')]
    return {names[row["case"]]: row["report"] for row in rows}


# drafts_sampled_right: stock vLLM's CPU fallback leaves the spread uninitialized
# (compat.fix_cpu_spec_sampling; tests/e2e/test_mtp_pd.py shows what that does to requests)
STOCK = {
    "spin_s": 1,
    "recheck_ms": 5000,
    "pings_kept": False,
    "pdcluster_logging": False,
    "drafts_sampled_right": False,
    "bar_semaphores": 1,  # tqdm's lock shared across processes
}


def test_a_process_pdcluster_did_not_launch_keeps_stock_vllm(probed):
    """A stock `vllm serve` in this venv loads our plugins too (no VLLM_PLUGINS): they do nothing."""
    assert probed["stock"] == {**STOCK, "amx_asked": False}


def test_a_process_pdcluster_launched_gets_the_fixes(probed):
    assert probed["launched"] == {
        "spin_s": 0.005,
        "recheck_ms": IDLE_RECHECK_MS,
        "pings_kept": True,
        "pdcluster_logging": True,
        "amx_asked": True,
        "drafts_sampled_right": True,
        "bar_semaphores": 0,  # none left in /dev/shm by an engine process killed with its tracker
    }


def test_the_amx_plugin_alone_acts_only_when_named(probed):
    """The vLLM P/D baseline on AMX CPUs: VLLM_PLUGINS names only the AMX permission; the step
    queues stay stock even where the marker is set, since vLLM does not load our other plugin."""
    assert probed["amx alone"] == {**STOCK, "amx_asked": True}
    assert probed["amx alone, marked"] == {**STOCK, "amx_asked": True}
