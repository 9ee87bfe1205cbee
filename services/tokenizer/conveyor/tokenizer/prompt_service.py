"""The tokenizer service's work, off the event loop: render, tokenize, decode."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from conveyor.tokenizer.chat_renderer import ChatRenderer
from conveyor.tokenizer.chat_request import ChatRequest, template_arguments
from conveyor.tokenizer.errors import InvalidRequest, check_context_length, check_text_length
from conveyor.tokenizer.prompt import TextPrompt, TokenIdsPrompt, TokenizedPrompt
from conveyor.tokenizer.prompt_tokenizer import PromptTokenizer, TokenizerFacts
from conveyor.tokenizer.settings import DEFAULT_MAX_CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class ServedTokenizer:
    """What the Info RPC reports."""

    model: str
    max_model_len: int
    """The model's own context length (max_position_embeddings): requests check against
    the engines' max_model_len, which they carry, and against this one without it."""
    facts: TokenizerFacts


class PromptService:
    """Renders and tokenizes prompts in a thread pool, so one long prompt
    does not hold up the event loop (HF fast tokenizers release the GIL).

    Every method raises InvalidRequest (or ContextLengthExceeded) for bad input; a prompt
    is checked against the max_model_len its request carries (the engines'), else the
    model's own. Text longer than `max_chars_per_token` x the model's max_model_len
    characters is refused before it is rendered or tokenized (a 20 MB prompt would take
    gigabytes and many seconds). A request's own chat template is refused unless
    `allow_request_chat_template`: a template of nested loops could hold a worker thread
    for as long as it likes.
    """

    def __init__(self, tokenizer: PromptTokenizer, renderer: ChatRenderer, model: str,
                 max_model_len: int, num_workers: int,
                 max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN,
                 allow_request_chat_template: bool = False):
        self._tokenizer = tokenizer
        self._renderer = renderer
        self.info = ServedTokenizer(model, max_model_len, tokenizer.facts)
        self.max_text_chars = max_chars_per_token * max_model_len
        self.allow_request_chat_template = allow_request_chat_template
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="conveyor-tokenize")

    async def render(self, request: ChatRequest) -> TokenizedPrompt:
        return await self._off_loop(self._render, request)

    async def tokenize(self, prompt: TextPrompt | TokenIdsPrompt) -> TokenizedPrompt:
        if isinstance(prompt, TokenIdsPrompt):
            return await self._off_loop(self._check_token_ids, prompt)
        return await self._off_loop(self._tokenize_text, prompt)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return await self._off_loop(self._tokenizer.decode, token_ids, skip_special_tokens)

    async def decode_each(self, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        return await self._off_loop(self._tokenizer.decode_each, token_ids, skip_special_tokens)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        return await self._off_loop(self._tokenizer.token_strings, token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable, *args):
        """Run fn in the pool, keeping the caller's context (request id in logs)."""
        call = partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def _render(self, request: ChatRequest) -> TokenizedPrompt:
        check_text_length(request.num_chars, self.max_text_chars, "the conversation")
        if request.chat_template and not self.allow_request_chat_template:
            raise InvalidRequest(
                "this server does not render a request's own chat_template (its operator can "
                "allow it with CONVEYOR_TOKENIZER_ALLOW_REQUEST_CHAT_TEMPLATE=true)")
        text = self._renderer.render(template_arguments(request))
        if not text:
            raise InvalidRequest("the chat template rendered an empty prompt")
        check_text_length(len(text), self.max_text_chars, "the rendered conversation")
        token_ids = self._tokenizer.encode(text, add_special_tokens=False)
        return self._validated(token_ids, text, request)

    def _tokenize_text(self, prompt: TextPrompt) -> TokenizedPrompt:
        check_text_length(len(prompt.text), self.max_text_chars)
        token_ids = self._tokenizer.encode(prompt.text, prompt.add_special_tokens)
        return self._validated(token_ids, prompt.text, prompt)

    def _check_token_ids(self, prompt: TokenIdsPrompt) -> TokenizedPrompt:
        if not prompt.token_ids:
            raise InvalidRequest("prompt token_ids is empty; send at least one token id")
        self._tokenizer.check_ids(prompt.token_ids)
        return self._validated(prompt.token_ids, "", prompt)

    def _validated(self, token_ids: list[int], text: str,
                   request: ChatRequest | TextPrompt | TokenIdsPrompt) -> TokenizedPrompt:
        """The prompt, truncated as the request asks (a text's text then is the kept
        tokens'), checked against its context length."""
        if not token_ids:
            raise InvalidRequest("the prompt has no tokens")
        max_model_len = request.max_model_len or self.info.max_model_len
        keep = request.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        if keep is not None and keep < 1:
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        if keep is not None and keep > max_model_len:
            raise InvalidRequest(f"truncate_prompt_tokens {keep} is greater than max_model_len "
                                 f"{max_model_len}; send at most {max_model_len}")
        if keep is not None and len(token_ids) > keep:
            token_ids = token_ids[-keep:]
            text = self._tokenizer.decode(token_ids, skip_special_tokens=False) if text else ""
        check_context_length(len(token_ids), request.max_tokens, max_model_len)
        return TokenizedPrompt(list(token_ids), text, max_model_len,
                               self._tokenizer.bad_word_sequences(request.bad_words))
