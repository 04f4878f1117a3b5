"""EngineHost around a real engine: what it does before it serves, and when its engine dies.

An engine compiles what vLLM compiles on first use before it serves, not on a user's request:
vLLM's sampler compiles (torch.compile) the ranks that logprobs report on the first request that
asks for them; the engine core compiles inside its step, so every stream of the engine waited
(2-3 s on an idle core; 70-80 s in this suite's busiest minute, on a shared core). EngineHost
warms the engine up with one request before it reports its URL, and clears the stats that
request made. torch's own log (TORCH_LOGS)
says when Dynamo traced a function; the engine's log says when it began to serve.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.cores import SECOND
from tests.support.engines import engine_core, run_engine, tiny_engine
from tests.support.handoff import NAME, complete, info, wait_for

pytestmark = pytest.mark.e2e

TRACED = "torchdynamo start tracing"  # what TORCH_LOGS=dynamo writes as Dynamo begins a compile
SERVING = "serving on http"


def test_a_first_logprobs_request_compiles_nothing(tmp_path):
    spec = tiny_engine("warm", dtype="float32", cpu_threads_bind=SECOND, extra_env={"TORCH_LOGS": "dynamo"})
    with run_engine(spec, tmp_path) as engine:
        assert info(engine)["stats"]["prefix_cache_queries"] == 0  # the warm-up is not traffic
        for extra in ({"logprobs": 2}, {"logprobs": 1, "echo": True}):  # sampled tokens', prompt's
            response = complete(engine, [5, 6, 7, 8, 9], 4, **extra)
            assert response.status_code == 200, response.text
        log = engine.log_path.read_text().splitlines()
    serving = next(i for i, line in enumerate(log) if SERVING in line)
    after = [line for line in log[serving:] if TRACED in line]
    assert not after, f"compiled while serving: {after}"
    assert any(TRACED in line for line in log[:serving]), "nothing compiled before serving: is TORCH_LOGS read?"


def test_a_request_to_an_engine_whose_core_died_is_refused_unstarted_and_the_engine_exits(tmp_path):
    """Once the host knows its engine core died (its info says unhealthy), a request is answered
    503 before vLLM sees it, saying so (nothing of it started: the router sends it to another
    replica), and the HTTP server stops: the standalone engine exits 1. Before, vLLM's app took
    the request and answered 500 ("EngineCore encountered an issue"), which the router relayed to
    the client as the request's answer (and before 45dbc20, a 500 saying "'State' object has no
    attribute 'server'" while the engine served on, dead)."""
    spec = tiny_engine("dies", dtype="float32", cpu_threads_bind=SECOND)
    with run_engine(spec, tmp_path) as engine:
        core = engine_core(engine.process.pid)
        core.kill()
        wait_for(lambda: info(engine)["healthy"] is False, 60, "the host to see its engine dead")
        response = complete(engine, [5, 6, 7, 8], 2)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "engine_dead" and "nothing of this request was started" in error["message"], error
        assert engine.process.wait(timeout=120) == 1


def test_a_stream_the_engine_is_writing_when_its_core_dies_is_cut_not_ended_with_an_error(tmp_path):
    """A stream vLLM is writing when its engine core dies is cut mid-answer (what the router sees
    of a replica that died: it continues the stream on another decode replica), its server then
    stops. Before, vLLM ended it with an error event, which the router relayed to the client as
    the end of the stream."""
    spec = tiny_engine("cut", dtype="float32", cpu_threads_bind=SECOND)
    body = {"model": NAME, "prompt": [5, 6, 7, 8], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with run_engine(spec, tmp_path) as engine:
        core = engine_core(engine.process.pid)
        events: list[str] = []
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            with engine.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    events.append(line)
                    if len(events) == 3:
                        core.kill()
        assert len(events) >= 3 and not any('"error"' in event for event in events), events[-3:]
        assert engine.process.wait(timeout=120) == 1
