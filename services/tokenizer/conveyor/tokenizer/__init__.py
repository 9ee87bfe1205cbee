"""Conveyor's tokenizer service: chat templates, token ids and prompt validation."""
