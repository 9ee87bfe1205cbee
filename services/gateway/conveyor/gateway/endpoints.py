"""What differs between the endpoints served on the generation path (chat, completions,
and the Responses API, whose kind is responses/endpoint.py's): an `EndpointKind` names
the request's id prefix and prompt parameter, and says how its prompts are tokenized,
how its response is shaped and what a finished request writes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.api.mapping import (
    num_top_logprobs,
    output_options,
    render_input,
)
from conveyor.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from conveyor.gateway.clients.tokenizer import PromptInput, PromptTokens
from conveyor.gateway.response_formats import ChatFormat, CompletionFormat, ResponseFormat

if TYPE_CHECKING:
    from conveyor.gateway.generation_request import GenerationRequest


PreparePrompts = Callable[["GenerationRequest"], Awaitable[list[PromptTokens]]]
"""A request's prompts, tokenized (its caller, model and body are known by then)."""


FormatOf = Callable[["GenerationRequest"], ResponseFormat]
"""The response format of a started request (its prompts and usage are known by then)."""


EndCalls = Callable[["GenerationRequest"], list[ScriptCall]]
"""What a finished request writes to Redis in its settlement's round trip."""


def _nothing_to_write(request: GenerationRequest) -> list[ScriptCall]:
    return []


def _never(request: GenerationRequest) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class EndpointKind:
    """What differs between the endpoints served on this path (chat, completions, and
    the Responses API, whose kind is responses/endpoint.py's)."""

    name: str
    id_prefix: str
    prompt_param: str
    format: FormatOf
    prepare_prompts: PreparePrompts
    end_calls: EndCalls = _nothing_to_write
    keeps_response: Callable[[GenerationRequest], bool] = _never
    """Whether the whole response is built (a stream's too) and kept on the request
    (`kept_response`) for `end_calls`."""


def format_of(shape: type[ResponseFormat]) -> FormatOf:
    """The format factory of a shape that needs only what every request has."""
    def make(request: GenerationRequest) -> ResponseFormat:
        body = request.body
        return shape(request.request_id, request.model.name, num_top_logprobs(body),
                     output_options(body), request.prompts)

    return make


async def _render_conversation(request: GenerationRequest) -> list[PromptTokens]:
    body: ChatCompletionRequest = request.body
    return [await request.pipeline.tokenizer.render(
        render_input(body, body.requested_max_tokens, request.model))]


async def _tokenize_prompts(request: GenerationRequest) -> list[PromptTokens]:
    pipeline = request.pipeline
    body: CompletionRequest = request.body

    async def tokenized(prompt: str | list[int]) -> PromptTokens:
        text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        tokens = await pipeline.tokenizer.tokenize(PromptInput(
            text=text, token_ids=token_ids, add_special_tokens=body.add_special_tokens,
            max_tokens=body.requested_max_tokens or 0, max_model_len=request.model.max_model_len,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            bad_words=list(body.bad_words or [])))
        if body.echo and token_ids is not None:  # echo shows the text of the (kept) ids
            tokens.prompt_text = await pipeline.tokenizer.decode(tokens.token_ids)
        return tokens

    return list(await asyncio.gather(*(tokenized(p) for p in body.prompts)))


def _stores(request: GenerationRequest) -> bool:
    return bool(request.body.store)


def _store_completion(request: GenerationRequest) -> list[ScriptCall]:
    """A complete chat completion with `store` true, kept with its metadata and messages."""
    if request.kept_response is None:
        return []
    body: ChatCompletionRequest = request.body
    completion = {**request.kept_response, "metadata": body.metadata or {}}
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return [request.pipeline.chat_completions.save_call(request.tenant.tenant_id, completion,
                                                        messages)]


CHAT = EndpointKind("chat_completions", "chatcmpl", "messages", format_of(ChatFormat),
                    _render_conversation, _store_completion, _stores)


COMPLETIONS = EndpointKind("completions", "cmpl", "prompt", format_of(CompletionFormat),
                           _tokenize_prompts)
