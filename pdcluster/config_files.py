"""A cluster YAML read from disk: parsed and validated (config.py's schema), paths in it made
relative to the file (wherever the command runs: the controller runs elsewhere), the credentials
it names read, and the checks that need the model's own files."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import yaml

from pdcluster.config import ClusterConfig, validate_config
from pdcluster.errors import ConfigError


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    config = validate_config(data, str(path))
    # Relative model/secret paths are relative to the YAML file.
    base = path.resolve().parent
    config.model.path = _local_path(config.model.path, base)
    if config.model.tokenizer:
        config.model.tokenizer = _local_path(config.model.tokenizer, base)
    config._base_dir = base
    # Files named in the YAML are relative to it, wherever the command runs (the controller
    # runs elsewhere); `up` reads them before it starts anything (read_credentials).
    for section, field in ((config.router, "api_keys_file"), (config.kv_transfer, "secret_file")):
        named = getattr(section, field)
        if named and not Path(named).is_absolute():
            setattr(section, field, str(base / named))
    if config.kv_transfer.tls is not None:
        config.kv_transfer.tls = config.kv_transfer.tls.resolved(base)
    check_model(config, str(path))
    return config


def _local_path(named: str, base: Path) -> str:
    """A relative model or tokenizer path that exists beside the YAML file (else here) as an
    absolute path; anything else (a hub name) as it was."""
    path = Path(named)
    if not path.is_absolute() and (base / path).exists():
        return str((base / path).resolve())
    if not path.is_absolute() and path.exists():
        return str(path.resolve())
    return named


def read_credentials(config: ClusterConfig) -> tuple[str | None, list[str]]:
    """The KV secret (None: none configured) and the router's API keys, read from the files the
    config names; a missing or empty file (TLS files included) is a ConfigError naming its field."""
    if config.kv_transfer.tls is not None:
        config.kv_transfer.tls.read()  # every engine reads them on its node; here they must exist too
    return config.kv_transfer.resolve_secret(config.base_dir), config.router.read_api_keys()


def check_model(config: ClusterConfig, source: str) -> None:
    """Checks that need the model's files (when the model is a local directory)."""
    model_config = Path(config.model.path) / "config.json"
    if not model_config.is_file():
        return
    try:
        hf = json.loads(model_config.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: model.path: cannot read {model_config}: {exc}") from None
    if config.speculative is not None and config.speculative.method == "mtp":
        layers = int(hf.get("num_nextn_predict_layers") or 0)
        if layers < 1:
            raise ConfigError(
                f"{source}: speculative.method: 'mtp' needs a model with MTP layers; "
                f"{model_config} has num_nextn_predict_layers={layers}"
            )
    limit = hf.get("max_position_embeddings")
    if config.model.max_model_len and limit and config.model.max_model_len > limit:
        raise ConfigError(
            f"{source}: model.max_model_len: {config.model.max_model_len} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )


def new_secret() -> str:
    return secrets.token_urlsafe(32)
