"""The Responses API as a kind of request on the one generation path: how its prompt is
rendered (the stored conversation it continues, then its input), its format, and the
stored response written with the settlement."""

from __future__ import annotations

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.api.mapping import chat_turns, num_top_logprobs, output_options, render_input
from conveyor.gateway.clients.tokenizer import PromptTokens
from conveyor.gateway.endpoints import EndpointKind
from conveyor.gateway.generation_request import GenerationRequest
from conveyor.gateway.responses.conversation import ResponsesChat
from conveyor.gateway.responses.output_format import ResponsesFormat
from conveyor.gateway.responses.truncation import render_fitting


async def _render_turn(request: GenerationRequest) -> list[PromptTokens]:
    """The conversation so far (loaded from the store) and this turn's input, rendered;
    with truncation "auto", its oldest turns dropped until it fits (responses/truncation.py)."""
    body: ResponsesChat = request.body
    turn, pipeline = body.turn, request.pipeline
    await turn.continue_from(pipeline.responses, pipeline.conversations,
                             request.tenant.tenant_id)
    render = render_input(body, body.requested_max_tokens, request.model)
    if turn.request.truncation == "auto":
        return [await render_fitting(pipeline.tokenizer, render, turn.instructions,
                                     turn.conversation)]
    render.messages = chat_turns(turn.messages)
    return [await pipeline.tokenizer.render(render)]


def _format(request: GenerationRequest) -> ResponsesFormat:
    body: ResponsesChat = request.body
    return ResponsesFormat(request.request_id, request.model.name, num_top_logprobs(body),
                           output_options(body), request.prompts, body.turn)


def _store(request: GenerationRequest) -> list[ScriptCall]:
    """The complete response and its conversation, when the request said store; then its
    items added to its `conversation` (a background one's only once it is saved)."""
    turn, pipeline, tenant_id = request.body.turn, request.pipeline, request.tenant.tenant_id
    calls = []
    if turn.stored is not None:
        calls.append(pipeline.responses.save_call(tenant_id, turn.stored, turn.final_event))
    if turn.new_items:
        saved = (pipeline.responses.saved_keys(tenant_id, request.request_id)
                 if turn.request.background else None)
        calls.append(pipeline.conversations.add_call(tenant_id, turn.conversation_id,
                                                     turn.new_items, saved))
    return calls


RESPONSES = EndpointKind("responses", "resp", "input", _format, _render_turn, _store)
