"""How the `pdcluster` command's process ends (cli.run). After a command that joined Ray it ends
with os._exit, past the interpreter's teardown, where Ray's metrics harvester thread can crash it
(SIGSEGV after the answer was printed: ray-project/ray#36885, seen as `status --json` exiting
-11 in a test run); what the command wrote must all be out first, and its exit status kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdcluster.cli import EXIT_BAD_INPUT
from pdcluster.config import json_schema

# The command as the console script runs it, in a process that counts as having joined Ray.
RUN_AS_AFTER_RAY = "import sys; from pdcluster import cli; cli._joined_ray = True; sys.argv[0] = 'pdcluster'; cli.run()"


@pytest.mark.parametrize("joined_ray", [False, True], ids=["plain-exit", "after-ray"])
def test_a_long_answer_through_a_pipe_arrives_whole_with_its_exit_status(joined_ray):
    code = RUN_AS_AFTER_RAY if joined_ray else RUN_AS_AFTER_RAY.replace("cli._joined_ray = True; ", "")
    done = subprocess.run([sys.executable, "-c", code, "config", "schema"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) > 1 << 14  # more than one buffer's worth
    assert json.loads(done.stdout) == json_schema()


def test_a_failing_command_keeps_its_exit_status_and_one_line(tmp_path):
    missing = tmp_path / "missing.yaml"
    done = subprocess.run(
        [sys.executable, "-c", RUN_AS_AFTER_RAY, "config", "validate", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1 and "missing.yaml" in done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["scale", "decode", "two"], "pdcluster scale: argument replicas: invalid int value: 'two'"),
        (["scale", "router", "2"], "pdcluster scale: argument role: invalid choice: 'router'"),
        (["launch"], "pdcluster: argument command: invalid choice: 'launch'"),
        (["status", "--watch", "0"], "pdcluster status: argument --watch: '0' is not a number of seconds > 0"),
        (["status", "--watch", "nan"], "pdcluster status: argument --watch: 'nan' is not a number of seconds > 0"),
        (["status", "--watch", "soon"], "pdcluster status: argument --watch: 'soon' is not a number of seconds > 0"),
        ([], "pdcluster: the following arguments are required: command"),
    ],
)
def test_an_invalid_argument_is_one_line_and_exit_2(args, needle):
    done = subprocess.run([sys.executable, "-m", "pdcluster.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(needle) and "--help" in done.stderr, done.stderr


def test_bench_hands_every_argument_to_the_benchmark():
    """`pdcluster bench --quick` was refused by pdcluster's own parser ("unrecognized arguments":
    argparse's REMAINDER takes no option first), so bench ran only with no argument at all.
    Every argument reaches bench/serve.py now: one it does not know is its error, under its usage,
    which names the command the user typed (it said `serve.py`)."""
    done = subprocess.run(
        [sys.executable, "-m", "pdcluster.cli", "bench", "--quick", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "pdcluster bench: error: unrecognized arguments: --no-such-flag"
    assert done.stderr.startswith("usage: pdcluster bench [-h]"), done.stderr


def test_status_scale_and_down_import_no_torch():
    """`pdcluster status` took ~3 s of CPU, most of it importing torch: Ray loads the controller's
    class to make its handle (importing orchestrator/controller.py), which imported the router,
    whose modules import torch (compat), and the CLI imported engine/spec.py, which imported the
    vLLM plugin. The test suite polls status every second while it waits for replicas, on 2 cores.
    What those commands import leaves torch and vLLM out (~1 s now)."""
    code = (
        "import sys; import pdcluster.cli, pdcluster.orchestrator.controller, pdcluster.orchestrator.status; "
        "print(sorted(m for m in ('torch', 'vllm', 'fastapi', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
