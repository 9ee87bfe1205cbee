"""Errors in what a caller sent; the servicer turns them into INVALID_ARGUMENT."""


class InvalidStreamError(ValueError):
    """A request (or an engine output) a text stream cannot accept; the message says why."""
