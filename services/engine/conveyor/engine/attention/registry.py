"""Attention backends by name.

The table maps a name to the class's import path, so naming `torch` never
imports Triton. It is immutable: adding a backend is a line here.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

from conveyor.engine.attention.backend import AttentionBackend, AttentionSpec

_BACKENDS = MappingProxyType({
    "torch": "conveyor.engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "conveyor.engine.attention.triton_backend:TritonAttentionBackend",
    "native": "conveyor.engine.attention.native_backend:NativeAttentionBackend",
})

BACKEND_NAMES = tuple(_BACKENDS)


def create_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    """Instantiate the backend registered as `name` for a model's attention spec."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    module_name, class_name = _BACKENDS[name].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(spec)
