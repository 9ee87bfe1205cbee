"""Conveyor's benchmarks: a serving client, baselines, the roofline and the suite runner.

`bench` is a plain package run from the repository root (`python -m bench.serving ...`,
`python bench/run_suite.py`); it is not installed.
"""
