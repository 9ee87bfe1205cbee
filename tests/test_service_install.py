"""Each service installs and starts on its own, with only what it declares.

For every service, a fresh virtual environment holding its pyproject.toml's dependencies and
conveyor-common's under constraints.txt, and nothing else: no dev requirements, no pip, no
setuptools; torch only for the engine, TORCH_VERSION installed as the Makefile does. In it,
every module of the service and of common imports (a module of one of the service's optional
extras, such as the engine's triton attention, may lack that extra), and each entry point runs
until it fails for a clear reason (a bad setting), never an ImportError. Celery imports its
Redis transport (and kombu that transport's `packaging`) only when it connects, so the batch
worker is started on the real Redis and the gateway's batch sender publishes a task there.

The environments (editable installs of this tree, so code changes need no rebuild) are built
once and kept under ~/.cache/conveyor/service-venvs, keyed by this tree, the Python, the
pyproject files, constraints.txt and the torch version; pip's cache makes a rebuild quick.

Without a fresh environment (fast): every third-party module a service's own code imports,
at module level or inside a function, comes from a distribution that the service, one of its
extras or conveyor-common declares.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("tokenizer", "detok", "engine", "gateway", "batch")
VENVS = Path.home() / ".cache" / "conveyor" / "service-venvs"
INSTALL_TIMEOUT_S = 900
SWEEP = """
import importlib, json, sys
failures = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = [getattr(exc, "name", None), f"{type(exc).__name__}: {exc}"]
print(json.dumps(failures))
"""
"""Run in a service's environment: import each module named; print the failures."""


def _project(service: str) -> Path:
    return ROOT / "common" if service == "common" else ROOT / "services" / service


def _pyproject(service: str) -> dict:
    return tomllib.loads((_project(service) / "pyproject.toml").read_text())["project"]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in requirements}


def _extras(service: str) -> set[str]:
    """Distributions of the service's optional extras (e.g. the engine's triton)."""
    extras = _pyproject(service).get("optional-dependencies", {})
    return _requirement_names([r for group in extras.values() for r in group])


def _makefile_variable(name: str) -> str:
    return re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]


def _modules(service: str) -> list[str]:
    """Every module under the project's conveyor/<name> package, `__main__`s left out
    (they run their command on import: the entry points run them)."""
    project = _project(service)
    names = []
    for path in sorted((project / "conveyor" / service).rglob("*.py")):
        parts = path.relative_to(project).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imported_modules(service: str) -> dict[str, str]:
    """Top-level third-party module -> one file of the service's package importing it."""
    package = _project(service) / "conveyor" / service
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for top in (name.split(".")[0] for name in names):
                if top != "conveyor" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_every_import_is_declared(service):
    declared = (_requirement_names(_pyproject(service)["dependencies"])
                | _requirement_names(_pyproject("common")["dependencies"]) | _extras(service))
    providers = importlib.metadata.packages_distributions()
    undeclared = {module: path for module, path in _imported_modules(service).items()
                  if not declared & {_normalize(d) for d in providers.get(module, [module])}}
    assert not undeclared, f"imported but not declared by {service} or common: {undeclared}"


def _venv_key(service: str) -> str:
    digest = hashlib.sha256(f"{sys.version}\n{_makefile_variable('TORCH_VERSION')}".encode())
    for path in ("common/pyproject.toml", f"services/{service}/pyproject.toml",
                 "constraints.txt"):
        digest.update((ROOT / path).read_bytes())
    return digest.hexdigest()[:16]


def _pip(venv: Path, *args: str) -> None:
    """pip (the dev environment's) installing into `venv`, which has none of its own."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-compile", *args],
                   check=True, cwd=ROOT, timeout=INSTALL_TIMEOUT_S)


def _build_venv(service: str, venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    if service == "engine":  # the Makefile's order: PyPI (or a local wheel), then TORCH_INDEX
        torch = f"torch=={_makefile_variable('TORCH_VERSION')}"
        try:
            _pip(venv, torch)
        except subprocess.CalledProcessError:
            _pip(venv, torch, "--index-url", _makefile_variable("TORCH_INDEX"))
    _pip(venv, "-c", "constraints.txt", "--config-settings", "editable_mode=compat",
         "-e", "common", "-e", f"services/{service}")


def _service_python(service: str) -> Path:
    """The service's environment's python, built unless this tree already has it (older
    builds of the same service are removed)."""
    home = VENVS / hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    venv = home / f"{service}-{_venv_key(service)}"
    if not venv.is_dir():
        partial = home / f".{venv.name}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        _build_venv(service, partial)
        for old in home.glob(f"{service}-*"):
            shutil.rmtree(old)
        partial.rename(venv)
    return venv / "bin" / "python"


def _env(**settings: str) -> dict[str, str]:
    """A clean environment: nothing of the dev environment's (PYTHONPATH, CONVEYOR_*)."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", **settings}


def _run(python: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], env=_env(**settings), capture_output=True,
                          text=True, timeout=300, cwd="/")


def _assert_no_import_error(output: str) -> None:
    error = re.search(r"^\w*(ModuleNotFound|Import)Error\b.*$", output, re.M)
    if error:
        pytest.fail(f"{error[0]}\n{output}")


@pytest.mark.slow
@pytest.mark.parametrize("service", SERVICES)
def test_every_module_imports_in_the_service_environment(service):
    python = _service_python(service)
    result = _run(python, "-c", SWEEP, *_modules("common"), *_modules(service))
    assert result.returncode == 0, result.stderr
    optional = {_normalize(name) for name in _extras(service)}
    failures = {module: message for module, (missing, message) in json.loads(result.stdout).items()
                if not (missing and _normalize(missing.split(".")[0]) in optional)}
    assert not failures, f"{service}: {failures}"


@pytest.mark.slow
@pytest.mark.parametrize("service", SERVICES)
def test_entry_point_stops_at_a_bad_setting(service):
    """`python -m conveyor.<service>` gets as far as reading its settings."""
    result = _run(_service_python(service), "-m", f"conveyor.{service}",
                  **{f"CONVEYOR_{service.upper()}_PORT": "not-a-port"})
    _assert_no_import_error(result.stdout + result.stderr)
    assert result.returncode != 0
    assert re.search(r"validation error for \w+Settings\s+port\b", result.stderr), result.stderr


@pytest.mark.slow
def test_tenancy_command_runs():
    result = _run(_service_python("gateway"), "-m", "conveyor.gateway.tenancy", "--help")
    _assert_no_import_error(result.stdout + result.stderr)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr


@pytest.mark.slow
def test_gateway_batch_sender_publishes(redis_url, prefix):
    """Publishing loads kombu's Redis transport (the first send connects)."""
    send = ("import asyncio, sys; from conveyor.gateway.batches.task_sender import TaskSender;"
            "asyncio.run(TaskSender(sys.argv[1], sys.argv[2]).send('conveyor.test', []))")
    result = _run(_service_python("gateway"), "-c", send, redis_url, prefix)
    _assert_no_import_error(result.stdout + result.stderr)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_batch_worker_starts(redis_url, prefix, tmp_path):
    """The worker connects to its broker and reports ready (the line it prints then)."""
    worker = subprocess.Popen(
        [str(_service_python("batch")), "-m", "conveyor.batch"], cwd="/", text=True,
        env=_env(CONVEYOR_BATCH_REDIS_URL=redis_url, CONVEYOR_BATCH_REDIS_PREFIX=prefix,
                 CONVEYOR_BATCH_FILES_DIR=str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output = _output_until(worker, "CONVEYOR_LISTENING", timeout_s=120)
    finally:
        worker.terminate()
        worker.wait(30)
    _assert_no_import_error(output)
    assert "CONVEYOR_LISTENING" in output, output


def _output_until(process: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """The process's output once a line holds `marker`, it exited, or the time is up."""
    lines: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            lines.append(line)
            if marker in line:
                seen.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not seen.wait(0.2) and process.poll() is None and time.monotonic() < deadline:
        pass
    return "".join(lines)
