"""Stored chat completions (`store: true`): kept per tenant, listed, changed and deleted."""
