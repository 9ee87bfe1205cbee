"""Every service image installs from the lock file (constraints.txt) with the Makefile's
torch version, and runs as a non-root user."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted(ROOT.glob("services/*/Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [tuple(line.split(None, 1)) for line in joined.splitlines() if line.strip()]


def _pip_installs(path: Path) -> list[str]:
    return [command.strip() for instruction, args in _instructions(path) if instruction == "RUN"
            for command in args.split("&&") if "pip install" in command]


def _makefile_torch_version() -> str:
    return re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]


def test_there_is_a_dockerfile_per_service():
    assert {p.parent.name for p in DOCKERFILES} >= {"gateway", "tokenizer", "engine", "detok"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_pip_install_takes_the_lock_file(path):
    copied = [args for instruction, args in _instructions(path) if instruction == "COPY"]
    assert any(args.split()[0] == "constraints.txt" for args in copied)
    installs = _pip_installs(path)
    assert installs
    for command in installs:
        assert re.search(r"\s-c\s+\S*constraints\.txt\b", command), command


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    """The instructions before the first FROM (global ARGs), then one list per stage."""
    stages: list[list[tuple[str, str]]] = [[]]
    for instruction in _instructions(path):
        if instruction[0] == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_torch_is_the_makefiles_version(path):
    """torch==${TORCH_VERSION} wherever torch is installed, the ARG in scope in that stage
    (a stage sees a global ARG only when it declares it again) and its default the
    Makefile's TORCH_VERSION."""
    declared = {}
    for index, stage in enumerate(_stages(path)):
        args = [a for i, a in stage if i == "ARG" and a.startswith("TORCH_VERSION")]
        declared.update(a.split("=", 1) for a in args if "=" in a)
        for instruction, command in stage:
            if instruction == "RUN" and re.search(r"pip install.*\btorch\b", command):
                assert "torch==${TORCH_VERSION}" in command, command
                assert index > 0 and args, f"TORCH_VERSION not declared in stage {index}"
    if declared:
        assert declared == {"TORCH_VERSION": _makefile_torch_version()}
    else:
        assert not re.search(r"\btorch\b", " ".join(_pip_installs(path)))


def test_the_cuda_engine_image_drops_the_torch_and_triton_pins():
    path = ROOT / "services" / "engine" / "Dockerfile"
    text = path.read_text()
    assert "grep -vE '^(torch|triton)==' constraints.txt > engine-constraints.txt" in text
    for command in _pip_installs(path):
        assert "-c engine-constraints.txt" in command, command


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_the_image_runs_as_a_non_root_user(path):
    instructions = _instructions(path)
    last_from = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    users = [args for instruction, args in instructions[last_from:] if instruction == "USER"]
    assert users, "the final stage sets no USER"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_the_installed_engine_carries_its_kernels_sources(tmp_path):
    """The engine image installs services/engine as a wheel and then compiles the C++
    kernels from the installed package (`python -m conveyor.engine.native`): the wheel must
    hold every source and header under native/csrc."""
    import shutil
    import subprocess
    import sys
    import zipfile

    project = tmp_path / "engine"  # a clean copy: no build/ or egg-info of earlier builds
    shutil.copytree(ROOT / "services" / "engine", project, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(project)],
                   check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("conveyor_engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = ROOT / "services" / "engine" / "conveyor" / "engine" / "native" / "csrc"
    sources = sorted(p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    assert sources, "no kernel sources found"
    missing = [s for s in sources if f"conveyor/engine/native/csrc/{s}" not in names]
    assert not missing, f"the engine's wheel lacks {missing}"
