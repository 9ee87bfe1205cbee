"""POST /v1/completions: tokenize each prompt, then the shared generation flow."""

from __future__ import annotations

import asyncio

from conveyor.gateway.api_models import CompletionRequest
from conveyor.gateway.generation_endpoint import EndpointKind
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.response_formats import CompletionFormat
from conveyor.gateway.tokenizer_records import PromptInput, PromptTokens


def prompt_input(prompt: str | list[int], body: CompletionRequest) -> PromptInput:
    text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    return PromptInput(text=text, token_ids=token_ids,
                       add_special_tokens=body.add_special_tokens,
                       max_tokens=body.requested_max_tokens or 0)


async def tokenize_prompts(pipeline: Pipeline, body: CompletionRequest) -> list[PromptTokens]:
    return list(await asyncio.gather(
        *(pipeline.tokenizer.tokenize(prompt_input(p, body)) for p in body.prompts)))


COMPLETIONS = EndpointKind(name="completions", id_prefix="cmpl", prompt_param="prompt",
                           format=CompletionFormat, prepare_prompts=tokenize_prompts)
