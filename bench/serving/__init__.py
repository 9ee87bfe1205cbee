"""A small serving benchmark client for OpenAI-compatible servers (/v1/completions over SSE).

The metric definitions follow `vllm bench serve`: see `metrics.py`.
"""
