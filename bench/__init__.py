"""Conveyor's benchmarks, behind one command line: `python -m bench COMMAND` (bench/__main__.py).

`bench` is a plain package run from the repository root; it is not installed.
"""
