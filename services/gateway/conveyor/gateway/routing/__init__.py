"""Routing across engine replicas (router.py: session affinity > prefix-cache hint > least
loaded, the live engines and their clients) and its settings (settings.py)."""
