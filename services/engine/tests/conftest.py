"""Fixtures every engine test folder shares: grammars over a tiny made-up vocabulary, so
structured-output tests run the real grammar library without the model's tokenizer."""

from __future__ import annotations

import llguidance
import pytest

from conveyor.engine.structured.grammar_compiler import GrammarCompiler


class TinyTokenizer:
    """A vocabulary of given byte strings, tokenized greedily (longest match first):
    what llguidance.TokenizerWrapper needs. `eos` is the id of the EOS entry."""

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes) -> list[int]:
        """Bytes outside the vocabulary are skipped."""
        ids, position = [], 0
        by_length = sorted((t for t in range(len(self.tokens)) if t != self.eos_token_id),
                           key=lambda t: -len(self.tokens[t]))
        while position < len(text):
            token = next((t for t in by_length if text.startswith(self.tokens[t], position)),
                         None)
            if token is not None:
                ids.append(token)
            position += len(self.tokens[token]) if token is not None else 1
        return ids


def tiny_compiler(tokens: list[bytes], eos: int, cache_size: int = 8) -> GrammarCompiler:
    """A real GrammarCompiler over the vocabulary `tokens` (one entry per token id)."""
    wrapper = llguidance.TokenizerWrapper(TinyTokenizer(tokens, eos))
    tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=eos)
    return GrammarCompiler(tokenizer, num_threads=1, cache_size=cache_size)


@pytest.fixture
def make_tiny_compiler():
    """`make_tiny_compiler(tokens, eos, cache_size=8)`: a GrammarCompiler over those tokens,
    closed after the test."""
    made = []

    def make(tokens: list[bytes], eos: int, cache_size: int = 8) -> GrammarCompiler:
        made.append(tiny_compiler(tokens, eos, cache_size))
        return made[-1]

    yield make
    for compiler in made:
        compiler.close()
