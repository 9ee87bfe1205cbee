"""The `native` backend's C++ kernels (native/csrc/paged_decode_attention.cpp and
paged_prefill_attention.cpp, one extension): whether this machine can run them, and loading
them (built once, cached; native/loader.py)."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from conveyor.engine.native import NativeBuildError, load_extension
from conveyor.engine.native.switches import switch

log = logging.getLogger("conveyor.engine.attention")

EXTENSION = "conveyor_paged_attention"
SOURCES = ("paged_decode_attention.cpp", "paged_prefill_attention.cpp")
HEAD_DIMS = (32, 64, 128)
"""Head sizes the kernel is instantiated for."""
KERNEL_PATHS = {"auto": 0, "avx2": 1, "avx512-cascade": 2, "avx512": 3}
"""The kernel's code paths by name (its `path` argument): auto takes avx512 where the CPU has
AVX-512 F/DQ/BW/VL (the cascade: requests sharing a block at a column take it in one pass; a
request's own blocks in 16-lane code), else avx2; avx512-cascade is the cascade with the AVX2
per-item code (the earlier default, kept as the A/B baseline). Forcing one serves the A/B
benchmarks and the tests that cover every path on an AVX-512 machine."""

PREFILL_PATHS = {"native": 0, "native-avx2": 1, "native-avx512": 2, "torch": None}
"""Where the backend sends prefill chunks (the A/B switch CONVEYOR_PREFILL_ATTENTION): its
prefill kernel on the widest path the CPU runs (native) or on one forced, by the kernel's `isa`
argument; or the torch backend's gather + SDPA (torch). `auto` resolves to one of them
(resolve_prefill_path)."""


def prefill_path_from_env() -> str:
    """CONVEYOR_PREFILL_ATTENTION (auto when unset; native/switches.py)."""
    return switch("CONVEYOR_PREFILL_ATTENTION")


def resolve_prefill_path(path: str, dtype: torch.dtype) -> str:
    """`path` with auto resolved for a model of `dtype`: torch's SDPA for bf16 on a CPU with
    AMX (torch runs bf16 SDPA as oneDNN brgemm on AMX tiles: 1.1-2.9x the native kernel's fp32
    arithmetic over bf16 rows, `python -m bench kernel prefill-attention --dtype bfloat16`),
    else native."""
    from conveyor.engine.native.cpu_features import cpu_features

    if path != "auto":
        return path
    return "torch" if dtype == torch.bfloat16 and cpu_features().amx else "native"


def load_decode_kernel() -> ModuleType:
    """The compiled kernel module; raises NativeBuildError when this CPU lacks AVX2+FMA
    or the extension does not build (no compiler, no ninja)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise NativeBuildError(f"the native attention kernel needs AVX2 and FMA; this CPU's "
                               f"torch capability is {capability}")
    return load_extension(EXTENSION, SOURCES)


@functools.cache
def native_unavailable_reason() -> str | None:
    """None when the kernel loads (building it if need be), else why not (logged once)."""
    try:
        load_decode_kernel()
    except NativeBuildError as exc:
        log.warning("native attention unavailable, using torch: %s", exc)
        return str(exc)
    return None
