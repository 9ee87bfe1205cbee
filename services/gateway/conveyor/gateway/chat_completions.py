"""POST /v1/chat/completions: render the conversation, then the shared generation flow."""

from __future__ import annotations

from conveyor.gateway.api_models import ChatCompletionRequest
from conveyor.gateway.generation_endpoint import EndpointKind
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.request_mapping import render_input
from conveyor.gateway.response_formats import ChatFormat
from conveyor.gateway.tokenizer_records import PromptTokens


async def render_conversation(pipeline: Pipeline,
                              body: ChatCompletionRequest) -> list[PromptTokens]:
    return [await pipeline.tokenizer.render(render_input(body, body.requested_max_tokens))]


CHAT = EndpointKind(name="chat_completions", id_prefix="chatcmpl", prompt_param="messages",
                    format=ChatFormat, prepare_prompts=render_conversation)
