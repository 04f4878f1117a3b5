"""Where these engines run, checked after the package's other modules have served their requests
(this module sorts last): the model in the engine core, a replica-bound engine's every thread
on its core, vLLM's sockets in each engine's own directory."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.e2e.handoff.common import BLOCK
from tests.support.cores import FIRST, SECOND
from tests.support.engines import thread_cores, vllm_processes
from tests.support.handoff import handoff, info, wait_for
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e


def test_engines_run_their_model_in_the_engine_core_unless_told_otherwise(engines):
    """Single-process CPU engines (engine/single_process.py): the model runs in the engine-core
    process, its engine thread bound to the configured core; with single_process off, vLLM's own
    layout (engine core + worker process). Both compute the same: every decode's output here is
    compared with `agg`'s, and decode-shm is the worker-process one."""
    single, split = info(engines["agg"]), info(engines["decode-shm"])
    assert single["single_process"] is True and single["single_process_reason"] == ""
    assert split["single_process"] is False
    processes = vllm_processes(engines["agg"].process.pid)
    assert processes == {"VLLM::EngineCore": [int(FIRST)]}, processes  # the reference's core
    processes = vllm_processes(engines["decode-shm"].process.pid)
    assert "VLLM::EngineCore" in processes and any(t.startswith("VLLM::Worker") for t in processes), processes


def test_a_replica_bound_engine_runs_every_thread_on_its_core(engines):
    """cpu_bind_scope replica (engine/cpu_bind.py): every thread of decode-faulty's process
    (vLLM's front end, the HTTP app, the KV error inbox) and of the engine core it started (its
    pull threads too) runs on its core (decode's: tests/support/cores.py) alone, after serving a handoff; `agg` and `decode` (scope
    engine) bind their engine core, while the rest of them may run on any core."""
    decode = engines["decode-faulty"]
    failed = info(decode)["stats"]["kv_pulls_failed"]
    assert handoff(engines["prefill"], decode, token_prompt(BLOCK + 5, offset=433), 2)[0].status_code == 200
    wait_for(lambda: info(decode)["stats"]["kv_pulls_failed"] > failed, 30, "the pull (failing, then recomputed)")
    assert thread_cores(decode.process.pid) == {(int(SECOND),)}
    assert info(decode)["replica_cores"] == [int(SECOND)]
    for name in ("agg", "decode"):
        assert info(engines[name])["replica_cores"] is None
    if len(os.sched_getaffinity(0)) > 1:
        assert len(thread_cores(engines["agg"].process.pid)) > 1
        assert len(thread_cores(engines["decode"].process.pid)) > 1


def test_vllms_sockets_live_in_each_engines_own_directory(engines):
    """vLLM's ZMQ sockets between an engine's processes are in a directory of that engine's own,
    not loose in the temp directory where a process that dies leaves them (test_lifetime: the
    directory goes when the engine stops)."""
    tmp = Path(tempfile.gettempdir())
    for name in ("prefill", "decode-shm"):  # single-process, and vLLM's own worker layout
        host = psutil.Process(engines[name].process.pid)
        children = host.children(recursive=True)
        # The host set it for the processes vLLM spawns (its own /proc environ predates that, as
        # does that of a helper started before the engine, such as multiprocessing's tracker).
        bases = {base for p in children if (base := p.environ().get("VLLM_RPC_BASE_PATH"))}
        assert len(bases) == 1, (name, bases)
        base = Path(bases.pop())
        assert base.parent == tmp and base.name.startswith("pdcluster-vllm-ipc-"), base
        bound = {c.laddr for p in (host, *children) for c in p.net_connections(kind="unix") if c.laddr}
        ipc = {Path(path) for path in bound if Path(path).parent in (tmp, base)}
        assert ipc and all(path.parent == base for path in ipc), (name, ipc)
