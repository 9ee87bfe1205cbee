"""Routing across engine replicas: session affinity > prefix-cache hint > least loaded.

Bindings live in Redis, so every gateway replica routes a session to the same engine.
"""
