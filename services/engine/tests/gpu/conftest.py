"""The GPU tests (`pytest -m gpu`): at full size on a CUDA device. Without one, the
Triton kernels still run, with tiny shapes, under the interpreter, which `triton.jit`
decides when the kernels import, so the variable is set before any test module imports
them; the tests that need a device skip."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
