"""Structured outputs: constraints on a request's output, compiled into grammars (llguidance)
off the step loop, and one matcher per sample whose token mask the sampler applies."""
