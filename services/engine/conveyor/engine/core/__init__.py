"""The engine core: requests, the KV block pool, the prefix cache and the scheduler (no tensors)."""
