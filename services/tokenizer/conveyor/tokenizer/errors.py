"""Bad input, as domain errors; the servicer turns them into INVALID_ARGUMENT."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request cannot be served as given; the message tells the user why."""


class ContextLengthExceeded(InvalidRequest):
    """prompt_len + max_tokens > max_model_len."""

    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int):
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt_len {prompt_len} + max_tokens {max_tokens} = {prompt_len + max_tokens} "
            f"tokens exceeds this model's maximum context length, max_model_len "
            f"{max_model_len}; shorten the prompt or lower max_tokens"
        )


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Raise ContextLengthExceeded unless the prompt and its completion fit."""
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(prompt_len, max_tokens, max_model_len)


class TextTooLong(InvalidRequest):
    """Text with more characters than max_model_len's tokens could hold (refused before it
    is tokenized); a context length exceeded, as the gateway reports it."""


def check_text_length(num_chars: int, max_chars: int, what: str = "the prompt") -> None:
    """Raise TextTooLong for text too long to fit max_model_len, before tokenizing it."""
    if num_chars > max_chars:
        raise TextTooLong(
            f"{what} has {num_chars} characters, more than the {max_chars} this service "
            f"tokenizes (CONVEYOR_TOKENIZER_MAX_CHARS_PER_TOKEN x max_model_len); shorten it")
