"""Faults and bad input against a running CPU cluster (2 prefill + 2 decode; its security:
test_security.py).

Replicas are killed for real (SIGKILL of the actor process, or of its engine core alone, as a crash
would); the router must retry what it can, report what it cannot, and the controller must replace
the dead replica.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.engine.vllm_segments import mapped_segments
from pdcluster.keys import engine_http_token
from tests.e2e.pd.conftest import PD_LEASE_S, PD_SECRET
from tests.support.engines import engine_core
from tests.support.prompts import heldout_prompts, token_prompt

pytestmark = pytest.mark.e2e

NAME = "tiny"
SECRET = PD_SECRET
ENGINE_HEADERS = {"Authorization": f"Bearer {engine_http_token(SECRET)}"}  # what the router sends engines
LEASE_S = PD_LEASE_S
# Tokens of each stream the decode kill interrupts: seconds of decoding on these 2 cores, so the
# victim is still streaming when it is killed (it is killed as soon as it reports a request).
LONG_TOKENS = 1500


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    """2 prefill + 2 decode, cache-aware routing (tests/e2e/conftest.py)."""
    return pd_cluster


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def kill(cluster):
    """Crash a replica: SIGKILL its actor process (looked up first, so the kill lands at once).
    Its pid comes from `status --json`: this process does not join Ray (a Ray driver's exit can
    crash, ray-project/ray#36885, which would fail a lane whose tests passed)."""

    def pid_of(replica: str) -> int:
        status = cluster.wait_status(
            lambda s: any(r["replica"] == replica and r["pid"] for r in s["replicas"]), 60, f"the pid of {replica}"
        )
        return next(r["pid"] for r in status["replicas"] if r["replica"] == replica)

    def crash(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    return SimpleNamespace(pid_of=pid_of, crash=crash)


def inflight(cluster, replica: str) -> float:
    """The router's in-flight count for a replica, from /metrics (cheap to poll)."""
    text = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    match = re.search(rf'pdcluster_replica_inflight\{{replica="{replica}",role="\w+"\}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def ready(status, role) -> list[str]:
    return sorted(r["replica"] for r in status["replicas"] if r["role"] == role and r["state"] == "ready")


def stream_text(client, prompt, max_tokens):
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in stream if c.choices)


# -- replicas dying ------------------------------------------------------------------------


def test_killed_prefill_is_retried_elsewhere_and_replaced(cluster, client, kill):
    before = cluster.status()
    assert ready(before, "prefill") == ["prefill-0", "prefill-1"]
    pid = kill.pid_of("prefill-0")
    with ThreadPoolExecutor(8) as pool:
        # The kill must land mid-flight: eight requests stay in flight, fresh ones replacing those
        # done, until the router counts one on prefill-0 (a prefill may end between two polls).
        futures: list = []
        deadline = time.monotonic() + 60
        while inflight(cluster, "prefill-0") == 0:
            assert time.monotonic() < deadline, "no request reached prefill-0"
            while sum(not f.done() for f in futures) < 8:
                futures.append(pool.submit(stream_text, client, token_prompt(900, offset=97 * len(futures)), 8))
            time.sleep(0.05)  # poll interval
        kill.crash(pid)
        results = [f.result() for f in futures]
    assert all(results)  # every request was served (retried on prefill-1 if needed)
    # Two ready again, the dead one not among them (a status read before the controller saw the
    # death still lists it ready: waiting for two alone passed at once there).
    status = cluster.wait_status(
        lambda s: len(ready(s, "prefill")) == 2 and "prefill-0" not in ready(s, "prefill"),
        300,
        "a replacement prefill replica",
    )
    dead = [r for r in status["retired"] if r["replica"] == "prefill-0"]
    assert dead and dead[0]["transitions"][-1][1] == "dead"
    assert stream_text(client, heldout_prompts()[0], 8)
    # cache-aware routing dropped the dead replica's index and follows its replacement's events
    cluster.wait_status(
        lambda s: (
            (known := s["cache"]["replicas"]).keys() == {r["replica"] for r in s["replicas"]}
            and all(c["source"] == "events" for c in known.values())
        ),
        60,
        "the router's cache index to follow the replacement",
    )


def retries(cluster, role: str) -> float:
    text = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    match = re.search(rf'pdcluster_retries_total\{{role="{role}"\}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def migrations(cluster) -> float:
    text = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    match = re.search(r'pdcluster_stream_migrations_total\{outcome="ok"\} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def long_request(i: int) -> dict:
    return {
        "model": NAME,
        "prompt": heldout_prompts()[i],
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def long_stream(cluster, i: int) -> tuple[str, str, int, str, int]:
    """(decode replica that answered, outcome, SSE lines, text, i) of long_request(i) streamed."""
    body = {**long_request(i), "stream": True}
    outcome, lines, finish, text = "incomplete", 0, None, []
    with (
        httpx.Client(base_url=cluster.endpoint, timeout=300) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        served_by = response.headers["x-pdcluster-decode"]
        for line in response.iter_lines():
            lines += line.startswith("data: ")
            if line.startswith('data: {"error"'):
                outcome = "error: " + line
            elif line == "data: [DONE]" and outcome == "incomplete":
                outcome = "complete" if finish == "length" else f"truncated (finish_reason={finish})"
            elif line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    text.append(choice.get("text") or "")
    return served_by, outcome, lines, "".join(text), i


def wait_running(url: str) -> None:
    """Until the engine at `url` reports a running request (asked of the engine itself: the router
    may relay far behind the engine on 2 busy cores)."""
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=30, headers=ENGINE_HEADERS) as http:
        while http.get(url + "/pdcluster/info").json()["stats"].get("running", 0) == 0:
            assert time.monotonic() < deadline, "no request reached the victim"
            time.sleep(0.05)  # poll interval


def test_killed_decode_streams_continue_on_the_survivor_and_it_is_replaced(cluster, client, kill):
    status = cluster.wait_status(lambda s: len(ready(s, "decode")) == 2, 300, "two decode replicas")
    victim, survivor = ready(status, "decode")
    assert inflight(cluster, victim) == inflight(cluster, survivor) == 0  # nothing leaked so far
    victim_pid = kill.pid_of(victim)
    retries_before, migrations_before = retries(cluster, "decode"), migrations(cluster)
    # Six long streams alternate between the two decode replicas (least loaded). The victim is
    # crashed as soon as its engine reports a running request (asked of the engine itself: the
    # router may relay far behind the engine on 2 busy cores, and a stream that was generated in
    # full before the kill is rightly delivered in full). LONG_TOKENS each: none is done by
    # then. Streams it was serving continue on the survivor from the tokens already sent
    # (migration); requests that had not begun streaming on it are prefilled again.
    victim_url = next(r["url"] for r in status["replicas"] if r["replica"] == victim)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_stream, cluster, i) for i in range(6)]
        wait_running(victim_url)
        engine_processes = psutil.Process(victim_pid).children(recursive=True)  # vLLM's engine core
        kill.crash(victim_pid)
        outcomes = [f.result(timeout=300) for f in futures]  # nothing hangs
    # The engine's own processes died with the actor (none left running as an orphan).
    assert engine_processes
    _, orphans = psutil.wait_procs(engine_processes, timeout=60)
    assert not orphans, [(p.pid, p.name()) for p in orphans]
    # Every stream completed in full (all LONG_TOKENS, finish_reason=length), without an error
    # event: none was cut, none truncated, none hung; and the crash did move (or reroute) at
    # least one request.
    assert len(outcomes) == 6
    assert all(outcome == "complete" for _, outcome, _, _, _ in outcomes), [o[:3] for o in outcomes]
    moved = migrations(cluster) - migrations_before
    rerouted = retries(cluster, "decode") - retries_before
    assert moved or rerouted, f"the crash affected no request: {[o[:3] for o in outcomes]}"
    # A stream the victim served (migrated mid-stream, or generated in full before the crash) is
    # token for token what an undisturbed run of its request gives (float32: greedy is exact).
    _, _, _, text, i = next(o for o in outcomes if o[0] == victim)
    undisturbed = httpx.post(cluster.endpoint + "/v1/completions", json=long_request(i), timeout=300).json()
    assert text == undisturbed["choices"][0]["text"]
    # New requests are served by the survivor while the replacement starts.
    assert all(stream_text(client, p, 8) for p in heldout_prompts()[10:14])
    cluster.wait_status(
        lambda s: len(ready(s, "decode")) == 2 and victim not in ready(s, "decode"),
        300,
        "a replacement decode replica",
    )


def test_a_replica_whose_engine_core_alone_dies_is_replaced(cluster, client, kill):
    """Only vLLM's engine core of a replica dies (SIGKILL of VLLM::EngineCore; its actor lives on):
    the actor reports the engine unhealthy, the controller retires the replica as dead, kills its
    actor and starts another, and the cluster serves throughout (the dead engine's HTTP server
    stops: a request sent its way is retried on the other prefill). vLLM's queues between the
    dead engine core and its worker (/dev/shm) are gone once the replacement runs; before, each
    replica replaced this way left them (400 MB of /dev/shm here: engine/vllm_segments.py)."""
    status = cluster.wait_status(lambda s: len(ready(s, "prefill")) == 2, 300, "two prefill replicas")
    victim = ready(status, "prefill")[0]
    victim_url = next(r["url"] for r in status["replicas"] if r["replica"] == victim)
    actor = psutil.Process(kill.pid_of(victim))
    core = engine_core(actor.pid)
    queues = mapped_segments(core.pid)
    assert len(queues) >= 2, "prefill's engine core maps no queue to a worker: does it keep its worker process?"
    core.kill()
    # Requests from the moment the host knows, or its replica is gone (a request vLLM took in the
    # instant before is in flight on the dead engine: its error is its answer).
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=30, headers=ENGINE_HEADERS) as http:
        try:
            while http.get(victim_url + "/pdcluster/info").json()["healthy"]:
                assert time.monotonic() < deadline, "the host never saw its engine die"
                time.sleep(0.05)  # poll interval
        except httpx.TransportError:
            pass  # the controller already ended the replica
    assert all(stream_text(client, p, 8) for p in heldout_prompts()[14:18])
    status = cluster.wait_status(
        lambda s: len(ready(s, "prefill")) == 2 and victim not in ready(s, "prefill"),
        300,
        "a replacement prefill replica",
    )
    dead = [r for r in status["retired"] if r["replica"] == victim]
    assert dead and dead[0]["transitions"][-1][1] == "dead"
    assert dead[0]["error"] == "engine died"  # status says why it was retired
    actor.wait(timeout=60)  # its actor was ended too (raises while it still runs)
    assert [path for path in queues if os.path.exists(path)] == []
    assert stream_text(client, heldout_prompts()[18], 8)


def test_a_decode_whose_engine_core_dies_mid_stream_has_its_streams_continued_elsewhere(cluster, kill):
    """Only vLLM's engine core of a decode replica dies while it streams (its actor lives on): its
    host cuts the streams it was writing, as a dead replica's would end (engine/dead_engine.py),
    and the router continues each on the other decode replica from the tokens already sent: every
    stream completes in full, none ends with an error event (before, vLLM's error event ended each
    stream the victim served). The replica is then replaced."""
    status = cluster.wait_status(lambda s: len(ready(s, "decode")) == 2, 300, "two decode replicas")
    victim = ready(status, "decode")[0]
    victim_url = next(r["url"] for r in status["replicas"] if r["replica"] == victim)
    actor = psutil.Process(kill.pid_of(victim))
    core = engine_core(actor.pid)
    migrations_before = migrations(cluster)
    with ThreadPoolExecutor(4) as pool:
        # prompts no replica has cached: the streams spread by load, both decodes get some
        futures = [pool.submit(long_stream, cluster, i) for i in range(20, 24)]
        wait_running(victim_url)
        core.kill()
        outcomes = [f.result(timeout=300) for f in futures]  # nothing hangs
    assert all(outcome == "complete" for _, outcome, _, _, _ in outcomes), [o[:3] for o in outcomes]
    assert migrations(cluster) > migrations_before, [o[:3] for o in outcomes]
    cluster.wait_status(
        lambda s: len(ready(s, "decode")) == 2 and victim not in ready(s, "decode"),
        300,
        "a replacement decode replica",
    )


def decode_tokens(cluster) -> float:
    """Tokens the ready decode engines have generated so far, from their own /metrics."""
    total = 0.0
    with httpx.Client(timeout=30, headers=ENGINE_HEADERS) as http:
        for row in cluster.status()["replicas"]:
            if row["role"] == "decode" and row["state"] == "ready":
                text = http.get(row["url"] + "/metrics").text
                total += sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)", text, re.M))
    return total


def test_client_disconnect_aborts_the_decode_request(cluster):
    """The client leaves after 5 events of a 3000-token stream: decode stops generating it (the
    engines idle alone would not show that: the stream ends by itself in seconds here)."""
    generated = decode_tokens(cluster)
    body = {
        "model": NAME,
        "prompt": heldout_prompts()[3],
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=cluster.endpoint, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events >= 5:
                    break  # the client goes away mid-stream
    status = cluster.wait_status(
        lambda s: all(r["running"] == 0 and r["kv_cache_usage"] == 0.0 for r in s["replicas"] if r["role"] == "decode"),
        30,
        "decode engines to abort the request and free its blocks",
    )
    assert all(r["inflight"] == 0 for r in status["replicas"])
    assert 0 < decode_tokens(cluster) - generated < body["max_tokens"] / 2  # aborted, not run to its end


# -- bad input -----------------------------------------------------------------------------


def post(cluster, path, content=None, json_body=None, headers=None):
    with httpx.Client(base_url=cluster.endpoint, timeout=60) as http:
        return http.post(path, content=content, json=json_body, headers=headers)


def assert_openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b'{"model": "tiny", "prompt": "x",', 400, "not valid JSON"),
        (b"\xff\xfe{}", 400, "UTF-8"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -5}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 10**9}).encode(), 400, "context length"),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "ten"}).encode(), 400, "integer"),
        (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "empty"),
        (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 400, "boolean"),
        (json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "'n'"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "nests deeper"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "not usable JSON"),
        (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": "tiny", "prompt": "x", "kv_transfer_params": {}}).encode(), 400, "kv_transfer_params"),
        (json.dumps({"model": "tiny", "prompt": "word " * 9000}).encode(), 400, "context"),
    ],
)
def test_bad_input_gets_openai_error(cluster, body, status, needle):
    response = post(cluster, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, status)
    assert needle.lower() in response.text.lower()


def test_huge_body_is_refused_and_cluster_keeps_serving(cluster, client):
    response = post(cluster, "/v1/completions", content=b"x" * (50 << 20), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    chat = post(cluster, "/v1/chat/completions", json_body={"model": NAME, "messages": "hello"})
    assert_openai_error(chat, 400)
    assert client.completions.create(model=NAME, prompt="import sys\n", max_tokens=4).choices[0].text is not None


def test_kv_controls_in_vllm_xargs_are_refused_and_no_engine_is_hurt(cluster, client):
    """vLLM reads kv_transfer_params and the KV cache report mode from a request's vllm_xargs
    too: a client's would reach an engine's KV connector past the router's own check (a string
    there was a 500). Refused, on the P/D path and on decode's own (n > 1), and every
    replica serves on, the same processes."""
    ready = cluster.wait_status(lambda s: all(r["state"] == "ready" for r in s["replicas"]), 300, "every replica ready")
    before = {r["replica"]: r["pid"] for r in ready["replicas"]}
    for xargs in (
        {"kv_transfer_params": "x"},
        {"kv_transfer_params": {"do_remote_prefill": 1}},
        {"kv_cache_report_mode": "full"},
    ):
        for n in (1, 2):  # several choices: sampled (vLLM refuses n > 1 greedy)
            body = {"model": NAME, "prompt": "import os\n", "max_tokens": 4, "n": n, "temperature": n - 1}
            assert_openai_error(post(cluster, "/v1/completions", json_body={**body, "vllm_xargs": xargs}), 400)
    for n in (1, 2):
        answer = client.completions.create(model=NAME, prompt="import sys\n", max_tokens=4, n=n, temperature=n - 1)
        assert len(answer.choices) == n
    after = cluster.status()["replicas"]
    assert {r["replica"]: r["pid"] for r in after} == before and all(r["state"] == "ready" for r in after)


def test_missing_max_tokens_uses_the_default(cluster):
    response = post(cluster, "/v1/completions", json_body={"model": NAME, "prompt": "import os\n"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.integers(-(2**300), 2**300)  # huge numbers
    | st.floats()  # NaN and infinities too: Python's JSON writes and reads them
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)


def _nest(depth_and_value):
    depth, value = depth_and_value
    for _ in range(depth):
        value = [value]
    return value


nested = st.tuples(st.integers(1, 80), json_values).map(_nest)  # deep nesting, past the router's limit
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([NAME, NAME, "other", 3, None]),
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 5000), max_size=8), json_values),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "x"]), "content": st.text(max_size=20)}
                ),
                max_size=3,
            ),
            json_values,
        ),
        "max_tokens": st.one_of(st.integers(-3, 40), json_values),
        "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), json_values),
        "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), json_values),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "logprobs": json_values,
        "seed": json_values,
        "n": st.one_of(st.integers(-2, 70), json_values),
        "min_tokens": st.one_of(st.integers(-2, 8), json_values),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
        "unknown_field": st.one_of(json_values, nested),
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=fields, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_requests_never_get_5xx(cluster, body, path):
    with httpx.Client(base_url=cluster.endpoint, timeout=60) as http:
        # As Python's json writes it (NaN, Infinity included; httpx's own encoder refuses those)
        response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            codes = [str(e["error"].get("code")) for e in events if isinstance(e.get("error"), dict)]
            assert not [c for c in codes if c.startswith("5")], (body, events[-3:])
    assert response.status_code < 500, (body, response.text[:500])


# -- counters --------------------------------------------------------------------------------


def test_api_metrics_count_outcomes(cluster):
    text = httpx.get(cluster.endpoint + "/metrics", timeout=30).text
    assert re.search(r'pdcluster_requests_total\{endpoint="completions",outcome="client_error"\} [1-9]', text)
    # The kills above were recovered and counted: a retry on another replica, or (a decode
    # stream cut mid-way) its migration; which one a kill produces depends on when it lands.
    retried = re.search(r'pdcluster_retries_total\{role="(prefill|decode)"\} [1-9]', text)
    assert retried or migrations(cluster) >= 1
