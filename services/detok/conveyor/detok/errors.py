"""Errors in what a caller sent; the servicer turns them into INVALID_ARGUMENT."""


class InvalidStreamError(ValueError):
    """A Detokenize message the stream cannot accept; the message says why."""
