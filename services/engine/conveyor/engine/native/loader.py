"""Build a C++ torch extension once, cache it on disk, import it.

A build lives in `<cache root>/<name>-<key>/`, the key hashing the sources and csrc/'s
headers and .inc bodies, the flags, torch's and Python's versions and the machine, so a changed
source or a new torch gets a fresh folder and an old build is never loaded against the wrong ABI. A
finished build leaves a `built` stamp; with it present the library is imported directly,
with no compiler or ninja involved (an image built once runs anywhere the same torch is).
Concurrent first builds of one key are serialized by an flock in the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("conveyor.engine.native")

CSRC = Path(__file__).parent / "csrc"
"""Where the engine's C++ sources live."""
CPU_CFLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
"""AVX2 + FMA + F16C (an fp16 KV pool's conversions), not -march=native: an image may run
on another host; OpenMP so at::parallel_for uses torch's intra-op threads (the libgomp torch
already loaded)."""
_STAMP = "built"


class NativeBuildError(RuntimeError):
    """An extension could not be built or imported; the message says why."""


def require_avx2(what: str) -> None:
    """NativeBuildError naming `what` when torch sees no AVX2 on this CPU (the extensions are
    built for AVX2 + FMA at least)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise NativeBuildError(f"{what} are built for AVX2; this CPU's torch capability is "
                               f"{capability}")


def cache_root() -> Path:
    """CONVEYOR_NATIVE_DIR, default ~/.cache/conveyor/native."""
    default = Path.home() / ".cache" / "conveyor" / "native"
    return Path(os.environ.get("CONVEYOR_NATIVE_DIR", default))


def build_dir(name: str, sources: Sequence[Path], cflags: Sequence[str]) -> Path:
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, platform.machine(), *cflags):
        digest.update(part.encode() + b"\0")
    # the headers and included bodies they may include
    for source in (*sources, *sorted(CSRC.glob("*.h")), *sorted(CSRC.glob("*.inc"))):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return cache_root() / f"{name}-{digest.hexdigest()[:16]}"


def load_extension(name: str, sources: Sequence[str | Path],
                   extra_cflags: Sequence[str] = CPU_CFLAGS) -> ModuleType:
    """The extension `name` built from `sources` (paths, or names under csrc/).

    Imported from the cache when a finished build is there, else compiled first
    (tens of seconds, logged). Raises NativeBuildError with the compiler's complaint
    when there is no compiler, no ninja, or the code does not build.
    """
    if name in sys.modules:
        return sys.modules[name]
    paths = [Path(s) if Path(s).is_absolute() else CSRC / s for s in sources]
    folder = build_dir(name, paths, extra_cflags)
    if not (folder / _STAMP).exists():
        _build(name, paths, extra_cflags, folder)
    return _import(name, folder)


def _build(name: str, paths: list[Path], cflags: Sequence[str], folder: Path) -> None:
    """Compile under an flock of the folder (the OS drops it if the builder dies, unlike
    torch's own lock file, which a killed build leaves behind for the next one to wait on)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / _STAMP).exists():  # another process may have built it meanwhile
            (folder / "lock").unlink(missing_ok=True)
            _compile(name, paths, cflags, folder)


def _compile(name: str, paths: list[Path], cflags: Sequence[str], folder: Path) -> None:
    from torch.utils import cpp_extension

    log.info("building native extension %s in %s", name, folder)
    start = time.perf_counter()
    path = os.environ.get("PATH", "")
    # the virtual environment's bin (the ninja package's script) even when not activated
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        cpp_extension.load(name, [str(p) for p in paths], extra_cflags=list(cflags),
                           extra_ldflags=["-fopenmp"], build_directory=str(folder))
    except Exception as exc:  # noqa: BLE001 - any failure of the toolchain means "no build"
        sys.modules.pop(name, None)
        raise NativeBuildError(f"native extension {name} did not build: "
                               f"{_last_lines(str(exc))}") from exc
    finally:
        os.environ["PATH"] = path
    (folder / _STAMP).write_text(f"{time.perf_counter() - start:.1f} s\n")
    log.info("built native extension %s in %.1f s", name, time.perf_counter() - start)


def _import(name: str, folder: Path) -> ModuleType:
    library = folder / f"{name}.so"
    if name in sys.modules:  # cpp_extension.load imported it while building
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"native extension {name}: no library at {library}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise NativeBuildError(f"native extension {name} did not import: {exc}") from exc
    sys.modules[name] = module
    return module


def _last_lines(text: str, num_lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-num_lines:])
