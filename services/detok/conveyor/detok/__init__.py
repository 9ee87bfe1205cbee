"""Conveyor's detokenizer service: token ids in, append-only text and stop-string matches out."""
