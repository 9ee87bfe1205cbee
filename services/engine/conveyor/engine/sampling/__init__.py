"""Turning the logits of a step into tokens: penalties, filters, seeded sampling, logprobs."""
