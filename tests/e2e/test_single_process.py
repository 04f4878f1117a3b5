"""Single-process CPU engines (engine/single_process.py): the model runs in the engine-core
process, bound to the role's cores, and generates exactly what vLLM's own two-process layout
(engine core + worker process) generates (float32: tokens and logprobs, identity.py)."""

from __future__ import annotations

import psutil
import pytest

from pdcluster.engine.spec import EngineSpec
from tests.support.engines import run_engines, tiny_engine
from tests.support.identity import Greedy, assert_same_greedy, identity_fields
from tests.support.prompts import token_prompt

pytestmark = pytest.mark.e2e

NAME = "tiny"
DTYPE = "float32"


def spec(engine_id: str, bind: str, single_process: bool) -> EngineSpec:
    return tiny_engine(
        engine_id, dtype=DTYPE, engine_args={"max_num_seqs": 8}, cpu_threads_bind=bind, single_process=single_process
    )


def vllm_processes(pid: int) -> dict[str, list[int]]:
    """The engine's vLLM processes by title (VLLM::EngineCore, VLLM::Worker...): the cores each
    one's main thread may run on."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        title = child.name()
        if title.startswith("VLLM::"):
            found[title] = child.cpu_affinity()
    return found


def test_single_process_engine_matches_the_worker_process_layout(tmp_path):
    prompts = [token_prompt(n, offset=37 * n) for n in (1, 17, 128, 129, 300)]
    with run_engines([spec("single", "0", True), spec("split", "1", False)], tmp_path) as engines:
        outputs, infos, processes = {}, {}, {}
        for engine_id, engine in engines.items():
            with engine.client() as client:
                infos[engine_id] = client.get("/pdcluster/info").json()
                body = {"model": NAME, "prompt": prompts, "max_tokens": 24, "temperature": 0, **identity_fields()}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                outputs[engine_id] = [Greedy.from_choice(c) for c in response.json()["choices"]]
            processes[engine_id] = vllm_processes(engine.process.pid)

    assert infos["single"]["single_process"] is True and infos["single"]["single_process_reason"] == ""
    assert infos["split"]["single_process"] is False
    # Single: one engine-core process, no worker process; its engine thread (the process's main
    # thread) is bound to the configured core. Split: vLLM's worker process holds the model.
    assert set(processes["single"]) == {"VLLM::EngineCore"}, processes["single"]
    assert processes["single"]["VLLM::EngineCore"] == [0]
    assert "VLLM::EngineCore" in processes["split"] and any(t.startswith("VLLM::Worker") for t in processes["split"])
    assert all(len(out.token_ids) == 24 for out in outputs["single"])
    for i, (single, split) in enumerate(zip(outputs["single"], outputs["split"])):
        assert_same_greedy(split, single, DTYPE, f"prompt {i}")
