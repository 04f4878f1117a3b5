"""Which CPU engines run their model in the engine-core process (engine/single_process.py),
decided on real vLLM configs of the shipped tiny model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pdcluster.engine.cpu_bind import explicit_cores
from pdcluster.engine.single_process import WORKER_CLS, use_single_process
from tests.support.cores import FIRST
from tests.support.engines import MODEL


@pytest.mark.parametrize(
    "mask, cores",
    [
        ("1", [1]),
        ("0-3", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("2,0-1", [0, 1, 2]),
        ("auto", None),
        ("nobind", None),
        ("", None),
        (None, None),
        ("0-1|2-3", None),
        ("one", None),
    ],
)
def test_explicit_cores(mask, cores):
    assert explicit_cores(mask) == cores


def vllm_config(**engine_args):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(model=str(MODEL), enforce_eager=True, max_model_len=512, **engine_args)
    return args.create_engine_config()


def test_one_worker_with_cores_runs_in_the_engine_core():
    config = vllm_config()
    assert config.parallel_config.distributed_executor_backend == "mp"  # vLLM's CPU platform
    assert use_single_process(config, [1]) is None
    assert config.parallel_config.distributed_executor_backend == "uni"
    assert config.parallel_config.worker_cls == WORKER_CLS


@pytest.mark.parametrize(
    "engine_args, cores, reason",
    [({}, None, "no explicit core list"), ({"tensor_parallel_size": 2}, [0, 1], "2 workers")],
)
def test_other_engines_keep_their_worker_process(engine_args, cores, reason):
    config = vllm_config(**engine_args)
    assert reason in use_single_process(config, cores)
    assert config.parallel_config.distributed_executor_backend == "mp"


def test_engine_thread_binding():
    """The binding applies to the calling thread (run in a child: it must not pin pytest)."""
    code = (
        "import os, torch; from pdcluster.engine.cpu_bind import bind_this_thread; "
        f"bind_this_thread([{FIRST}]); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=os.environ
    )
    assert out.stdout.split("\n")[-2] == f"[{FIRST}] 1"


BOUND_PROCESS = """
import json, os, subprocess, sys, threading
from pdcluster.engine.cpu_bind import bind_this_process
go, done, seen = threading.Event(), threading.Event(), {}
def later():
    seen["later"] = sorted(os.sched_getaffinity(0))
def early():  # running before the binding; starts a thread after it
    go.wait()
    seen["early"] = sorted(os.sched_getaffinity(0))
    thread = threading.Thread(target=later)
    thread.start()
    thread.join()
    done.set()
threading.Thread(target=early).start()
before = sorted(os.sched_getaffinity(0))
seen["bound"] = bind_this_process([int(sys.argv[1])])
go.set()
done.wait()
child = "import os; print(sorted(os.sched_getaffinity(0)))"
seen["child"] = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
seen["threads"] = sorted({str(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
print(json.dumps({"before": before, **seen}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to one core changes nothing on one core")
def test_a_bound_process_keeps_every_thread_and_child_on_its_cores():
    """cpu_bind_scope replica (engine/cpu_bind.py): threads running before the binding, threads
    they start after it and processes started after it all run on the bound core only (run in a
    child: it must not pin pytest)."""
    out = subprocess.run(
        [sys.executable, "-c", BOUND_PROCESS, FIRST],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=os.environ,
    )
    seen = json.loads(out.stdout)
    assert len(seen["before"]) >= 2  # the binding narrows something
    assert seen["bound"] >= 2  # the main thread and the early one
    assert seen["early"] == seen["later"] == [int(FIRST)]
    assert seen["child"].strip() == f"[{FIRST}]"
    assert seen["threads"] == [f"[{FIRST}]"]


def test_a_core_outside_this_machines_cpu_set_is_named_not_einval():
    """cpu_bind naming a core this process may not use (a container's CPU set, a smaller machine):
    a config error naming the cores and the usable ones, where the kernel says only EINVAL."""
    from pdcluster.engine.cpu_bind import bind_this_thread
    from pdcluster.errors import ConfigError

    usable, outside = sorted(os.sched_getaffinity(0)), max(os.sched_getaffinity(0)) + 1000
    message = f"cpu_bind: cores [{outside}] are not all among the CPUs this process may use {usable}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        bind_this_thread([outside])
    assert sorted(os.sched_getaffinity(0)) == usable
