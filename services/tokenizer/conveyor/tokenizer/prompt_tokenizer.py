"""The HF tokenizer behind the service: text to ids, ids checked and decoded."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.common.sampling_fields import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
)
from conveyor.tokenizer.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What the loaded tokenizer serves (the Info RPC)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


class PromptTokenizer:
    """Blocking tokenizer calls (run them off the event loop).

    HF fast tokenizers release the GIL while encoding and the calls here never
    change the tokenizer's truncation or padding, so threads may share it.
    """

    def __init__(self, tokenizer, extra_eos_ids: tuple[int, ...] = ()):
        self._tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.facts = TokenizerFacts(
            vocab_size=len(tokenizer),
            eos_token_ids=tuple(dict.fromkeys([*([eos] if eos is not None else []),
                                               *extra_eos_ids])),
            bos_token_id=tokenizer.bos_token_id,
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; raises InvalidRequest when it is empty."""
        if not text:
            raise InvalidRequest("prompt is empty; send text or token ids")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def bad_word_sequences(self, words: tuple[str, ...]) -> list[list[int]]:
        """vLLM's token sequences of bad words: each word as written (leading spaces
        dropped), and with one leading space where that tokenizes to a different first
        token and as many tokens (the word in the middle of a text)."""
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words holds {len(words)} words; at most "
                                 f"{MAX_BAD_WORDS} are taken")
        sequences: list[list[int]] = []
        for index, word in enumerate(words):
            if len(word) > MAX_BAD_WORD_CHARS:
                raise InvalidRequest(f"bad_words[{index}] is longer than {MAX_BAD_WORD_CHARS} "
                                     "characters")
            bare = self._tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare or len(bare) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequest(f"bad_words[{index}] must be 1 to {MAX_BAD_WORD_TOKENS} "
                                     f"tokens, got {len(bare)}")
            spaced = self._tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return sequences

    def check_ids(self, token_ids: list[int], what: str = "prompt token_ids") -> None:
        """Raise InvalidRequest for an id outside the vocabulary."""
        limit = self.facts.vocab_size
        for position, token_id in enumerate(token_ids):
            if token_id >= limit:
                raise InvalidRequest(
                    f"{what}[{position}] = {token_id} is outside the vocabulary "
                    f"(ids must be below {limit})")

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """Text of valid ids in one piece."""
        self.check_ids(token_ids, "token_ids")
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each valid id's token string from the vocabulary (e.g. "Ġworld")."""
        self.check_ids(token_ids, "token_ids")
        return self._tokenizer.convert_ids_to_tokens(token_ids)

    def decode_each(self, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        """The text of each valid id alone, in order."""
        self.check_ids(token_ids, "token_ids")
        return [self._tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
                for token_id in token_ids]
