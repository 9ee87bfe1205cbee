"""Baselines measured beside Conveyor in the same run."""
