"""Cluster YAML validation: every bad input is one clear line naming the YAML path, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdcluster.config import validate_config
from pdcluster.config_files import load_config, read_credentials
from pdcluster.errors import ConfigError
from pdcluster.orchestrator.engines import engine_spec
from pdcluster.vllm_plugin import IDLE_RECHECK_MS

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"path": "models/pdcluster-tiny-code"}}


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdcluster.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    config = load_config(ROOT / "configs" / name)
    assert config.model.served_name


@pytest.mark.parametrize(
    "data, message",
    [
        ({**BASE, "roles": {"decode": {"replicas": -1}}}, "roles.decode.replicas: must be ≥ 0"),
        ({**BASE, "rolez": {}}, "rolez: unknown key"),
        ({**BASE, "roles": {"prefill": {"replicaz": 2}}}, "roles.prefill.replicaz: unknown key"),
        ({**BASE, "router": {"port": "eighty"}}, "router.port: Input should be a valid integer"),
        ({**BASE, "router": {"port": -1}}, "router.port: must be ≥ 0"),
        (
            {**BASE, "roles": {"decode": {"engine_args": {"model": "other"}}}},
            "roles.decode.engine_args: 'model' is set once",
        ),
        (
            {**BASE, "roles": {"decode": {"engine_args": {"block_size": 64}}}},
            "roles.decode.engine_args.block_size: must equal roles.prefill",
        ),
        ({**BASE, "speculative": {"method": "eagle"}}, "speculative.method: Input should be 'mtp'"),
        ({**BASE, "kv_transfer": {"port_range": [80, 90]}}, "kv_transfer.port_range: need 1024"),
        ({**BASE, "kv_transfer": {"secret": "a", "secret_file": "b"}}, "kv_transfer: set either secret or secret_file"),
        ({**BASE, "roles": {"decode": {"cpu_bind": ["one"]}}}, "roles.decode.cpu_bind: 'one' is not a core list"),
        ({**BASE, "roles": {"prefill": {"onednn_cache": -1}}}, "roles.prefill.onednn_cache: must be ≥ 0"),
        (
            {**BASE, "roles": {"decode": {"cpu_bind_scope": "replica"}}},
            "roles.decode.cpu_bind_scope: 'replica' needs cpu_bind (the cores each replica is bound to)",
        ),
        ({**BASE, "roles": {"decode": {"cpu_bind_scope": "node"}}}, "roles.decode.cpu_bind_scope: Input should be"),
        ({"mode": "aggregated"}, "model: required"),
        (
            {**BASE, "mode": "aggregated", "roles": {"aggregated": {"replicas": 0}}},
            "roles.aggregated.replicas: aggregated mode needs ≥ 1 replica",
        ),
        (
            {**BASE, "roles": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}},
            "roles.decode.replicas: disaggregated mode needs ≥ 1 decode replica",
        ),
        (
            {**BASE, "roles": {"decode": {"placement": {"labels": {"pool": "in(a,b)"}}}}},
            "roles.decode.placement.labels: 'pool: in(a,b)' is not a Ray label value",
        ),
        (
            {**BASE, "roles": {"decode": {"placement": {"resources": {"CPU": 2}}}}},
            "roles.decode.placement.resources: 'CPU: 2.0': custom resources only",
        ),
        ({**BASE, "router": {"placement": {"zone": "a"}}}, "router.placement.zone: unknown key"),
        (
            {**BASE, "kv_transfer": {"mooncake": {"protocol": "udp"}}},
            "kv_transfer.mooncake.protocol: Input should be 'tcp' or 'rdma'",
        ),
        (
            {**BASE, "kv_transfer": {"mooncake": {"staging_chunk_bytes": 1 << 30}}},
            "kv_transfer.mooncake.staging_chunk_bytes: must be ≤ 268435456",
        ),
        ({**BASE, "router": {"policy": "random"}}, "router.policy: Input should be 'least_loaded', 'round_robin' or"),
        ({**BASE, "router": {"local_prefill_max_tokens": -1}}, "router.local_prefill_max_tokens: must be ≥ 0"),
        ({**BASE, "router": {"local_prefill_queue_tokens": -1}}, "router.local_prefill_queue_tokens: must be ≥ 0"),
        ({**BASE, "autoscale": {"prefill": {"min": 3, "max": 2}}}, "autoscale.prefill.min: must be ≤ max (3 > 2)"),
        (
            {**BASE, "autoscale": {"enabled": True, "decode": {"min": 2, "max": 3}}},
            "roles.decode.replicas: must be within autoscale.decode min..max (2..3), got 1",
        ),
        ({**BASE, "autoscale": {"budget": 1}}, "autoscale.budget: must be ≥ prefill.min + decode.min (2)"),
        (
            {**BASE, "autoscale": {"enabled": True, "decode": {"min": 0, "max": 2}}},
            "autoscale.decode.min: must be ≥ 1",
        ),
        (
            {**BASE, "mode": "aggregated", "roles": {"aggregated": {"replicas": 1}}, "autoscale": {"enabled": True}},
            "autoscale.enabled: the planner sizes prefill and decode",
        ),
        ({**BASE, "autoscale": {"margin": 1.5}}, "autoscale.margin: Input should be less than 1"),
        (
            {**BASE, "roles": {"decode": {"cpu_bind": ["3-0"]}}},
            "roles.decode.cpu_bind: '3-0' is not a core list like '0', '0-3' or '0,2' (ranges low-high)",
        ),
        ({**BASE, "roles": {"decode": {"cpu_bind": ["0-"]}}}, "roles.decode.cpu_bind: '0-' is not a core list"),
        (  # a replica is one engine: its data-parallel ranks would share its cores and KV endpoint
            {**BASE, "roles": {"decode": {"engine_args": {"data_parallel_size": 2}}}},
            "roles.decode.engine_args: 'data_parallel_size: 2' would make each replica 2 engines",
        ),
    ],
)
def test_errors_name_the_yaml_path(data, message):
    with pytest.raises(ConfigError) as info:
        validate_config(data, "cluster.yaml")
    assert str(info.value).startswith("cluster.yaml: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "content, message",
    [
        ("model: {path: m}\nroles: {decode: {replicas: -2}}\n", "roles.decode.replicas: must be ≥ 0"),
        ("model: {path: m}\nextra_key: 1\n", "extra_key: unknown key"),
        (
            "model: {path: m}\nroles: {prefill: {replicas: two}}\n",
            "roles.prefill.replicas: Input should be a valid integer",
        ),
        ("model: {path: m}\nroles: {prefill: {engine_args: {model: other-model}}}\n", "'model' is set once"),
        ("model: [unclosed\n", "not valid YAML (line"),
    ],
)
def test_cli_reports_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    for command in (["config", "validate", str(path)], ["up", str(path)]):
        result = cli(*command)
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert result.stdout == ""


def test_cli_validate_ok():
    result = cli("config", "validate", "configs/local-cpu.yaml")
    assert result.returncode == 0 and result.stdout.strip() == "ok"


def test_missing_file_is_bad_input(tmp_path):
    result = cli("config", "validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "No such file" in result.stderr


def test_engine_specs_follow_the_config():
    config = load_config(ROOT / "configs" / "local-cpu.yaml")
    prefill = engine_spec(config, "prefill", 0, "prefill-0")
    decode = engine_spec(config, "decode", 0, "decode-0")
    assert prefill.cpu_threads_bind == "0" and decode.cpu_threads_bind == "1"
    assert prefill.speculative == decode.speculative == {"method": "mtp", "num_speculative_tokens": 1}
    assert decode.async_scheduling is True and prefill.async_scheduling is None
    assert prefill.kv_transfer_config()["kv_role"] == "kv_producer"
    assert decode.kv_transfer_config()["kv_role"] == "kv_consumer"
    assert "secret" not in yaml.safe_dump(prefill.kv_extra)
    assert prefill.env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert prefill.env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
    assert prefill.env()["PDCLUSTER_WORKER_SPIN_MS"] == "5"
    assert prefill.single_process and decode.single_process  # roles.*.single_process (default on)
    assert prefill.cpu_bind_scope == decode.cpu_bind_scope == "replica"  # roles.*.cpu_bind_scope


def test_mtp_needs_a_model_with_mtp_layers(tmp_path):
    model = tmp_path / "plain-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 4096}')
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(model)}, "speculative": {"method": "mtp"}}))
    with pytest.raises(ConfigError, match="speculative.method: 'mtp' needs a model with MTP layers"):
        load_config(path)
    path.write_text(yaml.safe_dump({"model": {"path": str(model), "max_model_len": 8192}}))
    with pytest.raises(
        ConfigError, match=r"model.max_model_len: 8192 exceeds the model's max_position_embeddings \(4096\)"
    ):
        load_config(path)


# vLLM's process names -> the spin our plugin gives that process's step queues
SPIN_BY_PROCESS = {"VllmWorker-0": "0.005", "EngineCore": "0.0", "EngineCore_DP1": "0.0"}


def test_worker_spin_setting_reaches_vllms_step_queues():
    """roles.*.worker_spin_ms travels as an env var that our vLLM plugin (active in every vLLM
    process of a pdcluster engine) applies to vLLM's shared-memory queues before they are made: in workers as set, in
    engine cores (which only wait for their workers' results) as no spin. A reader that went to
    sleep re-reads its queue every IDLE_RECHECK_MS, not every 5 s (a lost wake-up ping stalled
    engines for 5 s). One interpreter imports vLLM once, then forks a process per vLLM process
    name, each loading the plugins as that process does (the fork keeps the modules the parent
    imported, so each child runs the plugin without importing most of vLLM again)."""
    code = (
        "import multiprocessing, os, inspect\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition\n"
        # What the plugin's fixes import, once here, not once per child (a fork keeps modules)
        "import vllm.v1.sample.rejection_sampler\n"
        f"for name in {list(SPIN_BY_PROCESS)!r}:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        multiprocessing.current_process().name = name\n"
        "        load_general_plugins()\n"
        "        idle = MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False)\n"
        "        print(name, inspect.unwrap(SpinCondition.__init__).__defaults__[0], idle.timeout_ms(), flush=True)\n"
        "        os._exit(0)\n"
        "    assert os.waitpid(pid, 0)[1] == 0, name\n"
    )
    engine_env = engine_spec(load_config(ROOT / "configs" / "local-cpu.yaml"), "prefill", 0, "prefill-0").env()
    env = {**os.environ, **engine_env}  # the engine marker and PDCLUSTER_WORKER_SPIN_MS=5
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    seen = {row[0]: row[1:] for row in rows if row and row[0] in SPIN_BY_PROCESS}
    assert seen == {name: [spin, str(IDLE_RECHECK_MS)] for name, spin in SPIN_BY_PROCESS.items()}, out.stdout


def _yaml(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump({"model": {"path": str(ROOT / "models" / "pdcluster-tiny-code")}, **sections}))
    return path


def test_key_and_secret_files_resolve_against_the_yaml_and_must_hold_something(tmp_path, monkeypatch):
    """router.api_keys_file and kv_transfer.secret_file are read relative to the YAML file,
    wherever the command runs, and refused when they hold nothing (an empty keys file would
    have left the router open: the two used to disagree)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "keys").write_text("# operators\nsk-one\n\nsk-two\n")
    (conf / "secret").write_text("s3cret\n")
    path = _yaml(conf / "c.yaml", router={"api_keys_file": "keys"}, kv_transfer={"secret_file": "secret"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    assert config.router.api_keys_file == str(conf / "keys")
    assert read_credentials(config) == ("s3cret", ["sk-one", "sk-two"])
    (conf / "keys").write_text("# nobody yet\n\n")
    with pytest.raises(ConfigError, match=r"router.api_keys_file: .*keys holds no key"):
        read_credentials(load_config(path))
    (conf / "keys").write_text("sk-one\n")
    (conf / "secret").write_text("\n")
    with pytest.raises(ConfigError, match=r"kv_transfer.secret_file: .*secret is empty"):
        read_credentials(load_config(path))
    missing = _yaml(conf / "m.yaml", router={"api_keys_file": "nope"})
    with pytest.raises(ConfigError, match=r"router.api_keys_file: No such file"):
        read_credentials(load_config(missing))
    # `up` stops on it with one line, before it starts anything
    result = cli("up", str(missing))
    assert result.returncode == 2 and "router.api_keys_file: No such file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_tls_files_resolve_against_the_yaml_and_up_refuses_a_missing_one(tmp_path):
    tls = {"cert_file": "tls/cert.pem", "key_file": "tls/key.pem", "ca_file": "/abs/ca.pem"}
    path = _yaml(tmp_path / "c.yaml", kv_transfer={"tls": tls})
    config = load_config(path)
    assert config.kv_transfer.tls.cert_file == str(tmp_path / "tls" / "cert.pem")
    assert config.kv_transfer.tls.ca_file == "/abs/ca.pem"
    # what an engine gets: the absolute paths (its own node must have the files there)
    assert config.kv_transfer.connector_config()["tls"]["key_file"] == str(tmp_path / "tls" / "key.pem")
    with pytest.raises(ConfigError, match=r"kv_transfer.tls.cert_file: .*No such file"):
        read_credentials(config)
    result = cli("up", str(path))
    assert result.returncode == 2 and "kv_transfer.tls.cert_file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_bad_credential_is_named_but_never_echoed():
    for section in ({"kv_transfer": {"secret": 987654321}}, {"router": {"api_keys": [987654321]}}):
        with pytest.raises(ConfigError) as info:
            validate_config({**BASE, **section})
        assert "987654321" not in str(info.value) and "valid string" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_chunk_bytes", 1 << 31),  # grpcio refuses messages near 2 GiB
        ("pull_timeout_seconds", 1e12),  # timedelta overflows (collective pairs' timeout)
        ("lease_seconds", 1e12),
        ("connect_timeout_seconds", float("inf")),
        ("lease_wait_seconds", 1e12),
    ],
)
def test_values_a_library_would_overflow_on_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=f"kv_transfer.{field}"):
        validate_config({**BASE, "kv_transfer": {field: value}})


def test_a_lease_under_a_second_is_a_config_error():
    """A consumer renews every sixth of a lease: 10 ms leases would have it renew every step."""
    with pytest.raises(ConfigError, match="kv_transfer.lease_seconds"):
        validate_config({**BASE, "kv_transfer": {"lease_seconds": 0.01}})


def test_yaml_numbers_are_cores_and_label_values():
    """`cpu_bind: [0, 1]` and `labels: {zone: 1}` as YAML writes them (numbers) are what their
    text says; they were refused with "Input should be a valid string"."""
    config = validate_config(
        {**BASE, "roles": {"decode": {"cpu_bind": [0, "2-3"], "placement": {"labels": {"zone": 1}}}}}, "test"
    )
    assert config.roles.decode.cpu_bind == ["0", "2-3"]
    assert config.roles.decode.placement.labels == {"zone": "1"}


def test_a_relative_tokenizer_resolves_against_the_yaml(tmp_path, monkeypatch):
    """model.tokenizer, like model.path, is relative to the YAML file wherever the command runs
    (it was left relative: the engines, started elsewhere, looked for it in their own cwd)."""
    conf = tmp_path / "conf"
    (conf / "tok").mkdir(parents=True)
    path = _yaml(conf / "c.yaml", model={"path": str(ROOT / "models/pdcluster-tiny-code"), "tokenizer": "tok"})
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    assert config.model.tokenizer == str(conf / "tok")
