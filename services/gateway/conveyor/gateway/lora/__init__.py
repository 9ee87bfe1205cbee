"""LoRA adapters served on the base model: their catalog, settings and admin endpoints."""
