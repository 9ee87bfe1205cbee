"""How token ids become text, and the one-shot decode that defines it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """Per-stream text options (the same meaning as HF `tokenizer.decode`)."""

    skip_special_tokens: bool = True
    """Drop special tokens (<|im_end|>, ...) from the text."""
    spaces_between_special_tokens: bool = False
    """Separate added tokens from neighbouring text with one space, as HF's slow
    tokenizers do (fast tokenizers ignore this option; with it off the text is
    exactly `tokenizer.decode(ids, skip_special_tokens=...)`)."""


def decode_full(tokenizer, token_ids: list[int], options: DecodeOptions) -> str:
    """The whole text of `token_ids` in one call: what the incremental
    detokenizer's deltas must add up to at a finish."""
    if not options.spaces_between_special_tokens:
        return tokenizer.decode(token_ids, skip_special_tokens=options.skip_special_tokens)
    segments = split_at_added_tokens(tokenizer, token_ids, options.skip_special_tokens)
    texts = (tokenizer.decode(segment, skip_special_tokens=False) for segment in segments)
    return " ".join(text for text in texts if text)


def id_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a one-argument call. A fast
    tokenizer that adds no clean-up step is asked directly (its Rust `decode`: transformers'
    wrapper around it costs ~3.5 us more a call, and a stream makes two calls a token);
    any other tokenizer goes through `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def split_at_added_tokens(tokenizer, token_ids: list[int], skip_special: bool) -> list[list[int]]:
    """Runs of ordinary tokens and single added tokens, in order; special
    tokens are left out when `skip_special`."""
    added = added_token_ids(tokenizer)
    special = special_token_ids(tokenizer) if skip_special else frozenset()
    segments: list[list[int]] = []
    run: list[int] = []
    for token_id in token_ids:
        if token_id in special:
            continue
        if token_id not in added:
            run.append(token_id)
            continue
        if run:
            segments.append(run)
            run = []
        segments.append([token_id])
    if run:
        segments.append(run)
    return segments


def added_token_ids(tokenizer) -> frozenset[int]:
    """Ids of tokens added on top of the model vocabulary (specials among them)."""
    return frozenset(tokenizer.added_tokens_decoder)


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `skip_special_tokens` drops: the named special tokens and every
    added token marked special (the rule of HF fast tokenizers)."""
    marked = (i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(tokenizer.all_special_ids).union(marked)
