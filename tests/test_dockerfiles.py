"""Every service image installs from the lock file (constraints.txt) with the Makefile's
torch version, found as the Makefile finds it, and runs as a non-root user; the CPU engine
image has no triton, and build contexts leave out what no image needs."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

import pytest

from devkit import deploy_manifests as m

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


def _makefile_variable(name: str) -> str:
    return re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]


def _torch_installs(path: Path) -> list[tuple[dict[str, str | None], str]]:
    """(the ARGs in scope with their defaults, the RUN command) for each RUN installing torch."""
    stages = _stages(path)
    defaults = dict((a.split("=", 1) + [None])[:2] for i, a in stages[0] if i == "ARG")
    found = []
    for stage in stages[1:]:
        scope = {}
        for instruction, args in stage:
            if instruction == "ARG":
                name, _, default = args.partition("=")
                scope[name] = default if "=" in args else defaults.get(name)
            elif instruction == "RUN" and re.search(r"pip install[^&]*\btorch==", args):
                found.append((dict(scope), args))
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_torch_is_found_as_the_makefile_finds_it(path):
    """The configured indexes first (PyPI, a mirror, a local wheel folder), then the build
    argument TORCH_INDEX, for the same requirement."""
    for scope, command in _torch_installs(path):
        first, fallback = re.search(r"\((.*?)\|\|(.*?)\)", command).groups()
        requirement = re.search(r"torch==\S+", first)[0]
        assert "--index-url" not in first and requirement in fallback, command
        assert re.search(r"--index-url \$\{TORCH_INDEX\}", fallback), command
        assert scope.get("TORCH_INDEX"), "TORCH_INDEX is not a build argument with a default"


@pytest.mark.parametrize("service", ["tokenizer", "detok"])
def test_the_tokenizer_conversion_takes_the_cpu_torch_the_makefile_names(service):
    [(scope, command)] = _torch_installs(ROOT / "services" / service / "Dockerfile")
    assert "torch==${TORCH_VERSION}+cpu" in command
    assert scope["TORCH_INDEX"] == _makefile_variable("TORCH_INDEX")


def test_the_cpu_engine_image_is_the_cpu_build_without_triton():
    """The CPU overlay builds torch's +cpu build from the Makefile's index; the engine installs
    no triton extra: only PyPI's CUDA torch brings triton (it pins its own)."""
    [(scope, command)] = _torch_installs(ROOT / "services" / "engine" / "Dockerfile")
    assert "torch==${TORCH_VERSION}${TORCH_BUILD}" in command and scope["TORCH_BUILD"] == ""
    cpu_args = m.load_compose("docker-compose.cpu.yml")["services"]["engine"]["build"]["args"]
    assert cpu_args == {"TORCH_BUILD": "+cpu", "TORCH_INDEX": _makefile_variable("TORCH_INDEX")}
    for command in _pip_installs(ROOT / "services" / "engine" / "Dockerfile"):
        assert "triton" not in command, command


def test_build_contexts_leave_out_what_no_image_needs():
    """.dockerignore keeps .git, virtual environments, generated stubs and caches out of the
    context, and nothing a Dockerfile copies."""
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    assert {".git", "**/.venv", "**/__pycache__", "common/conveyor/v1"} <= set(patterns)
    for path in DOCKERFILES:
        for instruction, args in _instructions(path):
            if instruction == "COPY" and not args.startswith("--from"):
                for source in args.split()[:-1]:
                    excluded = [p for p in patterns if fnmatch.fnmatch(source.rstrip("/"), p)]
                    assert not excluded, f"{path.parent.name} copies {source}: {excluded}"
