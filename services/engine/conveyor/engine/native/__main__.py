"""Build (or check) every C++ extension of the engine into the cache, e.g. at image build:

    CONVEYOR_NATIVE_DIR=/opt/conveyor/native python -m conveyor.engine.native

Exits non-zero, printing the compiler's complaint, when one does not build.
"""

from __future__ import annotations

import logging
import sys

from conveyor.engine.native.loader import NativeBuildError


def _builds():
    """The loaders of the engine's extensions (one line per extension)."""
    from conveyor.engine.attention.native_kernel import load_decode_kernel
    from conveyor.engine.lora.lora_linear import load_lora_kernel
    from conveyor.engine.model.block_weights import load_block_kernels
    from conveyor.engine.model.cpu_linear import load_gemv
    from conveyor.engine.model.fused_ops import load_fused_ops

    return [load_decode_kernel, load_fused_ops, load_block_kernels, load_gemv, load_lora_kernel]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for load in _builds():
        try:
            module = load()
        except NativeBuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{module.__name__}: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
