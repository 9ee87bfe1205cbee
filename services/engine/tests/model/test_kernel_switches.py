"""The kernel switches (native/switches.py): defaults, values, and a clear refusal of a value
a switch does not take, at import of the module that reads it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.engine.native.switches import SWITCHES, switch


def test_unset_switches_take_their_default(monkeypatch):
    for name, spec in SWITCHES.items():
        monkeypatch.delenv(name, raising=False)
        assert switch(name) == spec.choices[0]


def test_a_set_switch_reads_its_value_and_refuses_others(monkeypatch):
    monkeypatch.setenv("CONVEYOR_PREFILL_ATTENTION", "torch")
    assert switch("CONVEYOR_PREFILL_ATTENTION") == "torch"
    monkeypatch.setenv("CONVEYOR_PREFILL_ATTENTION", "sdpa")
    with pytest.raises(ValueError, match="CONVEYOR_PREFILL_ATTENTION='sdpa' is not one of "
                                         "auto, native, native-avx2, native-avx512, torch"):
        switch("CONVEYOR_PREFILL_ATTENTION")


def test_a_bad_value_stops_the_module_that_reads_it_with_the_choices():
    """A typo is not silently taken as the default (it used to be, for CONVEYOR_SWIGLU)."""
    code = "import conveyor.engine.model.fused_ops"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False,
                            env={"CONVEYOR_SWIGLU": "avx9", "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    assert "CONVEYOR_SWIGLU='avx9' is not one of auto, avx2, avx512, off" in result.stderr
