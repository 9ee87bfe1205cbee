"""The engine's C++ extensions (csrc/), built on first use and cached; see loader.py."""

from conveyor.engine.native.loader import (
    CPU_CFLAGS,
    CSRC,
    NativeBuildError,
    cache_root,
    load_extension,
    require_avx2,
)

__all__ = ["CPU_CFLAGS", "CSRC", "NativeBuildError", "cache_root", "load_extension",
           "require_avx2"]
