"""The whole system through its CLI and endpoint: `pdcluster up` (local Ray head, controller,
prefill + decode actors, router), the official openai client, scaling under load, status,
`down` leaving nothing behind."""

from __future__ import annotations

import json
import re
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import PIPE

import httpx
import openai
import psutil
import pytest

from pdcluster.keys import engine_http_token
from tests.support.cluster import TEST_DTYPE, cli, cluster_processes, cluster_up, write_config
from tests.support.cma import cross_process_copies_refused
from tests.support.cores import FIRST, SECOND
from tests.support.hugepages import hinted_kib, thp_available
from tests.support.identity import Greedy, assert_same_greedy, greedy_completion
from tests.support.prompts import heldout_prompts, token_prompt

pytestmark = pytest.mark.e2e

API_KEY = "test-key-123"
NAME = "tiny"
PROMPTS = heldout_prompts()[:6]
CHAT = [[{"role": "user", "content": p}] for p in heldout_prompts()[6:9]]
MAX_TOKENS = 16
# Requests sharing a prefix of more than two of the CPU's 128-token KV blocks: from the second
# on, the decode replica holds those blocks in its own prefix cache and pulls only the rest.
SHARED_PREFIX = token_prompt(2 * 128 + 40, offset=900)
PREFIXED = [SHARED_PREFIX + token_prompt(30, offset=1700 + 97 * i) for i in range(3)]
RAY_MARKERS = ("raylet", "gcs_server", "ray::", "default_worker.py", "ray.scripts.scripts", "VLLM::")


def greedy(http: httpx.Client, prompt, headers: dict | None = None) -> Greedy:
    """A greedy completion with its logprobs (tokens and logprobs compared, identity.py)."""
    return greedy_completion(http, prompt, MAX_TOKENS, NAME, headers)


@pytest.fixture(scope="module")
def reference(reference_engine):
    """Greedy outputs of one aggregated engine with the cluster's model and dtype (conftest.py)."""
    engine = reference_engine
    # The OpenAI client sends its api_key as the bearer: the engine key.
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine_http_token(engine.secret))
    completions = [
        client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    chats = [
        client.chat.completions.create(model=NAME, messages=m, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .message.content
        for m in CHAT
    ]
    prefixed = [
        client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for p in PREFIXED
    ]
    with engine.client() as http:
        logprobs = {
            "completions": [greedy(http, p) for p in PROMPTS],
            "prefixed": [greedy(http, p) for p in PREFIXED],
        }
    return {"completions": completions, "chat": chats, "prefixed": prefixed, "logprobs": logprobs}


STARTED: list[float] = []  # when this module's cluster came up


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reference):
    STARTED.append(time.time())
    home = tmp_path_factory.mktemp("pdcluster-home")
    config = write_config(home / "cluster.yaml", name="e2e-local", router={"api_keys": [API_KEY]})
    with cluster_up(home, config) as running:
        yield running


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.endpoint + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_completions_match_aggregated_engine(cluster, client, reference):
    for prompt, expected in zip(PROMPTS, reference["completions"]):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == expected
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as http:
        for i, (prompt, expected) in enumerate(zip(PROMPTS, reference["logprobs"]["completions"])):
            assert_same_greedy(expected, greedy(http, prompt, headers), TEST_DTYPE, f"prompt {i}")


def test_streaming_completions_match(client, reference):
    for prompt, expected in zip(PROMPTS[:3], reference["completions"]):
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_chat_matches_streaming_and_not(client, reference):
    for messages, expected in zip(CHAT, reference["chat"]):
        got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].message.content == expected
        stream = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected


def test_openai_semantics_through_pd_are_one_engines(cluster, client, reference):
    """What used to be refused or mangled by the P/D path: several choices, min_tokens above the
    prefill's one token, logprobs: false, a prompt one token short of the context."""
    prompt = PROMPTS[0]
    several = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.7, n=2)
    assert sorted(c.index for c in several.choices) == [0, 1] and all(c.text for c in several.choices)
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, n=2)  # as one engine
    at_least = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"min_tokens": 4}
    )
    assert at_least.usage.completion_tokens >= 4
    for stream in (False, True):
        answer = client.chat.completions.create(
            model=NAME, messages=CHAT[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=False, stream=stream
        )
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else None
        assert (text if stream else answer.choices[0].message.content) == reference["chat"][0]
    edge = client.completions.create(model=NAME, prompt=token_prompt(1023, offset=4000), max_tokens=1, temperature=0)
    assert edge.usage.completion_tokens == 1 and edge.usage.prompt_tokens == 1023


def test_requests_sharing_a_prefix_match(cluster, client, reference):
    """Streamed (first token from the prefill) and whole, each prompt after the first finds the
    shared prefix in the decode replica's prefix cache; the rest is pulled where it belongs."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=cluster.endpoint, timeout=120) as http:
        for i, (prompt, expected) in enumerate(zip(PREFIXED, reference["prefixed"])):
            got = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == expected
            stream = client.completions.create(
                model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
            want = reference["logprobs"]["prefixed"][i]
            assert_same_greedy(want, greedy(http, prompt, headers), TEST_DTYPE, f"prefixed prompt {i}")


def _first_token_sources(cluster) -> dict[str, float]:
    text = httpx.get(cluster.endpoint + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    found = re.findall(r'^pdcluster_first_token_source_total\{role="(\w+)"\} ([0-9.]+)$', text, re.M)
    return {role: float(value) for role, value in found}


def test_streams_take_their_first_token_from_the_prefill(cluster, client, reference):
    """A streamed request gets the prefill's first token and the decode replica continues after
    it: same text, one response id, usage as the client's own request; a request the split
    cannot serve as asked (a stop string) takes the classic path, also right."""
    before = _first_token_sources(cluster)
    prompt, expected = PROMPTS[1], reference["completions"][1]
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len({c.id for c in chunks}) == 1
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks]
    assert counts[0] == (whole.usage.prompt_tokens, 1)  # the first token, counted as vLLM would
    assert counts[-1] == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert [done for _, done in counts] == sorted(done for _, done in counts)
    classic = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, stop=["<never-in-code>"]
    )
    assert "".join(c.choices[0].text for c in classic if c.choices) == expected
    after = _first_token_sources(cluster)
    assert after.get("prefill", 0) - before.get("prefill", 0) == 1
    assert after.get("decode", 0) - before.get("decode", 0) == 2  # the JSON request and the stop one


def test_no_secret_file_outlives_the_engines_start(cluster):
    """Each engine actor wrote the KV secret to a private file for its engine's processes; once
    they run, the file is gone (an actor killed later leaves nothing behind)."""
    files = Path(tempfile.gettempdir()).glob(f"pdcluster-secret-*-{cluster.name}-*.secret")
    left = [p for p in files if p.stat().st_mtime >= STARTED[0]]
    assert left == []


def test_models_health_and_metrics(cluster):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=cluster.endpoint, timeout=30) as http:
        models = http.get("/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == [NAME]
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics", headers=headers).text
    for name in (
        "pdcluster_ttft_seconds",
        "pdcluster_itl_seconds",
        "pdcluster_e2e_latency_seconds",
        "pdcluster_requests_total",
        "pdcluster_replica_inflight",
        "pdcluster_kv_handoff_bytes_total",
        "pdcluster_kv_pull_seconds_total",
        "pdcluster_kv_lease_wait_seconds_total",
        "pdcluster_kv_load_report_seconds_total",
        "pdcluster_kv_pulls_one_sided_total",
        "pdcluster_handoff_gap_seconds",
        "pdcluster_replica_waiting",
        "pdcluster_spec_draft_tokens_total",
        "pdcluster_spec_acceptance_rate",
        "pdcluster_spec_mean_accepted_length",
        "pdcluster_first_token_source_total",
    ):
        assert name in metrics, name


def test_api_key_required(cluster):
    body = {"model": NAME, "prompt": "x = 1", "max_tokens": 2}
    with httpx.Client(base_url=cluster.endpoint, timeout=30) as http:
        missing = http.post("/v1/completions", json=body)
        wrong = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        right = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert wrong.status_code == 401
    assert right.status_code == 200


def _stream_one(client, i: int) -> str:
    stream = client.completions.create(
        model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in stream if c.choices)


def test_32_concurrent_streams_complete(client):
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: _stream_one(client, i), range(32)))
    assert len(results) == 32 and all(results)


def test_status_json_reflects_cluster(cluster):
    status = cluster.status()
    assert status["endpoint"] == cluster.endpoint
    roles = sorted((r["role"], r["state"]) for r in status["replicas"])
    assert roles == [("decode", "ready"), ("prefill", "ready")]
    decode = next(r for r in status["replicas"] if r["role"] == "decode")
    assert decode["ttft_p50"] is not None and decode["itl_p50"] is not None
    assert decode["async_scheduling"] is False and "cpu" in decode["async_scheduling_reason"]
    # local-cpu.yaml binds each engine to a core: models run in their engine-core processes
    assert all(r["single_process"] is True and r["single_process_reason"] == "" for r in status["replicas"])
    # and binds every thread of each replica to that core (roles.*.cpu_bind_scope replica)
    assert {r["role"]: r["replica_cores"] for r in status["replicas"]} == {
        "prefill": [int(FIRST)],
        "decode": [int(SECOND)],
    }
    stats = decode["stats"]
    assert stats["spec_draft_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["spec_mean_accepted_length"] >= 1
    assert stats["kv_pulls_ok"] > 0 and stats["kv_bytes_received"] > 0
    # the handoff's stages around the pulls, and the gap the streams continued after the
    # prefill's first token saw between it and decode's first
    assert stats["kv_lease_wait_seconds"] > 0 and stats["kv_load_report_seconds"] > 0
    # one node (auto: shm): once the first pull taught decode the prefill's addresses, it reads
    # live leases itself; where copies between processes are refused, every pull uses the ring
    if cross_process_copies_refused() is None:
        assert 0 < stats["kv_pulls_one_sided"] < stats["kv_pulls_ok"]
    else:
        assert stats["kv_pulls_one_sided"] == 0
    with httpx.Client(base_url=cluster.endpoint, timeout=30) as http:
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    [gaps] = [
        line.split()[-1] for line in metrics.splitlines() if line.startswith("pdcluster_handoff_gap_seconds_count")
    ]
    assert float(gaps) > 0
    assert "secret" not in str(status).lower()
    table = cli(cluster.home, "status", "--name", cluster.name).stdout
    assert cluster.endpoint in table and "MTP acceptance" in table
    assert "async scheduling off (turned off by vLLM's cpu platform)" in table
    assert "worker process kept" not in table


PUBLISHER = """
import sys, time
from ray._private.utils import publish_error_to_driver
from ray._raylet import GcsClient

gcs = GcsClient(address=sys.argv[1])
publish_error_to_driver("pdcluster_test", sys.argv[2], gcs)
print("publishing", flush=True)
while True:  # until stopped: all through the command's life, so some land while it is connected
    publish_error_to_driver("pdcluster_test", sys.argv[2], gcs)
    time.sleep(0.02)
"""


def test_status_json_stays_parseable_while_ray_reports_cluster_errors(cluster):
    """Ray's driver prints each cluster-wide error (a node marked dead, a worker killed) to
    sys.stdout from a thread of its own (ray/_private/worker.py listen_error_messages): the CLI's
    stdout must still be only `status --json`'s document, the errors going to stderr. (The
    errors come from a process holding the local head's Ray token, as the CLI does.)"""
    import os
    import subprocess
    import sys

    from pdcluster.orchestrator.session import set_ray_auth

    session = json.loads((cluster.home / f"{cluster.name}.json").read_text())
    message = "a cluster error every driver prints"
    env = dict(os.environ)
    set_ray_auth(env, session["ray_token_path"])
    argv = [sys.executable, "-c", PUBLISHER, session["ray_address"], message]
    publisher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert publisher.stdout.readline() == "publishing\n"  # its first error is out
        result = cluster.cli("status", "--json", "--name", cluster.name)
    finally:
        publisher.kill()
        publisher.wait()
    assert message in result.stderr  # the errors did reach the command while it ran
    assert json.loads(result.stdout)["endpoint"] == cluster.endpoint


def _model_processes(home: Path) -> list[psutil.Process]:
    """The process holding each model of this cluster's prefill and decode actors: the engine
    core (single-process engines, local-cpu.yaml's default), else its vLLM worker process."""
    holders = []
    for pid in cluster_processes(home, ("VLLM::EngineCore",)):
        try:
            proc = psutil.Process(pid)
            if any(
                " ".join(p.cmdline()).startswith(("ray::PrefillWorker", "ray::DecodeWorker")) for p in proc.parents()
            ):
                workers = [c for c in proc.children() if " ".join(c.cmdline()).startswith("VLLM::Worker")]
                holders.extend(workers or [proc])
        except psutil.Error:
            continue
    return holders


def test_engine_processes_get_the_cpu_settings(cluster):
    """Each engine's model runs in its engine core, with the bounded oneDNN cache and its KV
    cache hinted for 2 MiB pages (and the short step-queue spin, for engines that keep a worker
    process). Whether the kernel backs the hint is its own (tests/support/hugepages.py): printed."""
    holders = _model_processes(cluster.home)
    assert len(holders) == 2
    assert all(p.name() == "VLLM::EngineCore" for p in holders)  # no worker processes
    for proc in holders:
        assert proc.environ().get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == "128"
        assert proc.environ().get("PDCLUSTER_WORKER_SPIN_MS") == "5"
        if thp_available():
            hinted, huge = hinted_kib(proc.pid)
            # kv_cache_gib: 1, less what rounds its tensors' ends to 2 MiB pages
            assert hinted * 1024 >= (1 << 30) - (64 << 20), f"{hinted} KiB hinted for huge pages"
            print(f"engine {proc.pid}: {huge >> 10} of {hinted >> 10} MiB hinted on 2 MiB pages")


def ctrl_c_reaches_it() -> None:
    """(In a child, before it runs its command.) Ctrl-C's default: a test run started in the
    background (`make test &`) passes SIGINT on ignored, and Python keeps an ignored SIGINT so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_scale_decode_up_and_down_under_load(cluster, client):
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def load():
        i = 0
        while not stop.is_set():
            try:
                assert _stream_one(client, i)
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and fails the test
                failures.append(repr(exc))
            i += 1

    # An operator watching (a JSON line each time status changes; an interval no wait here reaches).
    watch = cluster.popen(
        "status",
        "--json",
        "--watch",
        "600",
        "--name",
        cluster.name,
        stdout=PIPE,
        text=True,
        preexec_fn=ctrl_c_reaches_it,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout))  # a full pipe would stop it
    reader.start()
    # One client keeps a stream in flight through both scalings (the new replica's start, the old
    # one's drain); a second only took CPU from the replica starting on this 2-core machine.
    threads = [threading.Thread(target=load)]
    for t in threads:
        t.start()
    try:
        cli(cluster.home, "scale", "decode", "2", "--wait", "--name", cluster.name)
        assert sorted(r["state"] for r in cluster.status()["replicas"] if r["role"] == "decode") == ["ready", "ready"]
        served_before = done[0]
        cli(cluster.home, "scale", "decode", "1", "--wait", "--name", cluster.name)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        watch.send_signal(signal.SIGINT)  # Ctrl-C: how a watch ends
        watch.wait(timeout=120)
        reader.join(120)
    assert failures == []
    assert watch.returncode == 0
    assert all(a != b for a, b in zip(lines, lines[1:]))  # printed on changes only
    states = [[r["state"] for r in json.loads(line)["replicas"] if r["replica"] == "decode-1"] for line in lines]
    seen = [s[0] for s in states if s]
    assert seen[:1] == ["starting"] and "ready" in seen, seen  # the new replica's start, as it went
    assert done[0] > served_before > 0
    status = cluster.status()
    assert [r["state"] for r in status["replicas"] if r["role"] == "decode"] == ["ready"]
    retired = [r for r in status["retired"] if r["role"] == "decode"]
    assert len(retired) == 1
    assert [state for _, state in retired[0]["transitions"]] == ["starting", "ready", "draining", "dead"]


def test_with_prefill_scaled_to_zero_decode_serves_requests_alone(cluster, client, reference):
    """No prefill replica: every request is computed by decode alone (not 503), greedy output
    unchanged, counted as the decode path; /health stays ok."""
    before = cluster.status()["routes"].get("decode", 0)
    cli(cluster.home, "scale", "prefill", "0", "--wait", "--name", cluster.name)
    assert not [r for r in cluster.status()["replicas"] if r["role"] == "prefill"]
    assert httpx.get(cluster.endpoint + "/health", timeout=10).status_code == 200
    for prompt, expected in zip(PROMPTS[:3], reference["completions"]):
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.choices[0].text == expected
    assert _stream_one(client, 0)
    status = cluster.status()
    assert status["routes"]["decode"] >= before + 4
    assert "routes: decode" in cli(cluster.home, "status", "--name", cluster.name).stdout


def test_down_leaves_no_processes(cluster):
    assert cluster_processes(cluster.home, RAY_MARKERS)  # what is looked for is found while up
    watch = cluster.popen("status", "--watch", "1", "--name", cluster.name, stdout=PIPE, stderr=PIPE, text=True)
    assert "e2e-local" in watch.stdout.readline()  # it watches: the table's first line
    cli(cluster.home, "down", "--name", cluster.name, timeout=300)
    # A watch of a cluster that goes down ends, saying so in one line.
    _, said = watch.communicate(timeout=120)
    assert watch.returncode == 1 and said.strip().splitlines()[-1] == (
        "pdcluster: cluster 'e2e-local': its controller is gone (the cluster was stopped)"
    ), said
    deadline = time.monotonic() + 30
    while (left := cluster_processes(cluster.home, RAY_MARKERS)) and time.monotonic() < deadline:
        time.sleep(0.5)  # processes exit asynchronously after their group is signalled
    assert left == {}
    assert not (cluster.home / f"{cluster.name}.json").exists()
