"""Conveyor's gateway: the OpenAI-compatible HTTP/SSE API over the tokenizer,
engine and detok services."""
