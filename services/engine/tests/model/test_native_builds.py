"""`python -m conveyor.engine.native` (make native, the engine image) builds every kernel: an
extension it leaves out is compiled at the engine's first start, or not at all in an image
without a compiler."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from conveyor.engine.native import __main__ as native_main
from conveyor.engine.native import loader


def test_the_build_command_covers_every_kernel_source(monkeypatch):
    built: list[str] = []

    def record(name, sources, extra_cflags=loader.CPU_CFLAGS):
        built.extend(Path(source).name for source in sources)
        return SimpleNamespace(__name__=name, __file__=f"/cache/{name}.so")

    native_main._builds()  # imports the kernels' modules, which may bind load_extension
    real = loader.load_extension
    for module in list(sys.modules.values()):
        if getattr(module, "load_extension", None) is real:
            monkeypatch.setattr(module, "load_extension", record)
    assert native_main.main() == 0
    sources = sorted(path.name for path in loader.CSRC.glob("*.cpp"))
    assert sorted(built) == sources
