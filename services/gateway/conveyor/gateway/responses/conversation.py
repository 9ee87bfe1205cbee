"""A Responses API request as the chat request the path serves.

The conversation the model continues is, in order: the `instructions` (a system
message), the stored conversation of `previous_response_id` or the items of `conversation`
(loaded once the caller is known: `ResponsesTurn.continue_from`), and the `input` items,
each as chat messages (items.py). A complete response adds its input and output items to
its `conversation`.

Tools (flat function tools), tool_choice, text.format (-> response_format),
max_output_tokens (-> max_completion_tokens), sampling and the fields chat shares
(metadata, service_tier, ...) map one to one; the chat request's own checks then apply
(the output plan, limits, quotas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import PrivateAttr

from conveyor.gateway.api.fields import StreamOptions
from conveyor.gateway.api.schemas import ChatCompletionRequest
from conveyor.gateway.api.tools import (
    ChatMessage,
    FunctionName,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    NamedToolChoice,
    Tool,
)
from conveyor.gateway.responses.conversation_store import ConversationStore, duplicate_item
from conveyor.gateway.responses.items import (
    chat_messages,
    kept_items,
    kept_output,
    read_back,
    repeated_id,
)
from conveyor.gateway.responses.request_body import (
    FunctionChoice,
    FunctionTool,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from conveyor.gateway.responses.store import ResponseStore, StoredResponse


@dataclass(slots=True)
class ResponsesTurn:
    """One POST /v1/responses: the body as sent, the conversation it continues, and,
    once its response is complete, what is stored (when `store`)."""

    request: ResponsesRequest
    input_messages: list[ChatMessage]
    history: list[ChatMessage] = field(default_factory=list)
    """The stored conversation of previous_response_id, or the items of `conversation`."""
    loaded: bool = False
    """Whether `history` was loaded (continue_from runs once)."""
    stored: StoredResponse | None = None
    """What to store, set by the format when the response is complete."""
    new_items: list[dict] = field(default_factory=list)
    """What a complete response adds to its `conversation`: its input, then its output."""
    created_at: int | None = None
    """When a background response was created (its Response keeps that time)."""
    first_sequence_number: int = 0
    """The first streamed event's number (2 after a background stream's first two)."""
    final_event: tuple[int, bytes] | None = None
    """A streamed background response's last event, written with the stored response."""

    @property
    def instructions(self) -> list[ChatMessage]:
        text = self.request.instructions
        return [ChatMessage(role="system", content=text)] if text else []

    @property
    def conversation(self) -> list[ChatMessage]:
        """The conversation so far, then this input."""
        return [*self.history, *self.input_messages]

    @property
    def messages(self) -> list[ChatMessage]:
        """What the model reads (uncut): the instructions, then the conversation."""
        return [*self.instructions, *self.conversation]

    async def continue_from(self, responses: ResponseStore, conversations: ConversationStore,
                            tenant_id: str) -> None:
        """Load the conversation of previous_response_id (404 if the tenant has none, 400
        if it is not complete) or the items of `conversation` (404 if the tenant has no
        such conversation); once (a background response loads it when created)."""
        if self.loaded:
            return
        previous_id, conversation_id = self.request.previous_response_id, self.conversation_id
        if previous_id is not None:
            previous = await responses.get_answered(tenant_id, previous_id,
                                                    "previous_response_id")
            self.history = [ChatMessage.model_validate(m) for m in previous.conversation]
        elif conversation_id is not None:
            items = await conversations.items(tenant_id, conversation_id, "conversation")
            given = [] if isinstance(self.request.input, str) else [
                {"id": item.id} for item in self.request.input if item.id]
            repeated = repeated_id(given, (item["id"] for item in items))
            if repeated is not None:
                raise duplicate_item(repeated, "input")
            self.history = chat_messages(read_back(items))
        self.loaded = True

    @property
    def conversation_id(self) -> str | None:
        return self.request.conversation_id

    def answered_with(self, response: dict, answer: ChatMessage) -> None:
        """Keep what the complete `response` stores (when `store`) and adds to its
        conversation (when it has one)."""
        if self.request.store:
            self.stored = StoredResponse(response, self.conversation_with(answer))
        if self.conversation_id is not None:
            self.new_items = [*kept_items(self.request.input), *kept_output(response["output"])]

    def conversation_with(self, answer: ChatMessage | None) -> list[dict]:
        """The conversation to store with the response: all but the instructions (and
        no answer yet while a background response waits)."""
        answers = [answer] if answer is not None else []
        return [m.model_dump(exclude_none=True) for m in (*self.conversation, *answers)]


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses API request is served as; `turn` is what only the
    Responses format and store need."""

    _turn: ResponsesTurn | None = PrivateAttr(None)

    @property
    def turn(self) -> ResponsesTurn:
        return self._turn


def chat_request(body: ResponsesRequest) -> ResponsesChat:
    """The chat request `body` is served as (its input's messages; the stored
    conversation joins them when the turn continues one)."""
    turn = ResponsesTurn(body, chat_messages(body.input))
    text = body.text
    chat = ResponsesChat(
        model=body.model, messages=turn.messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, user=body.user, stream=body.stream,
        stream_options=StreamOptions(include_obfuscation=body.stream_options.include_obfuscation)
        if body.stream_options else None,
        logprobs=body.wants_logprobs, top_logprobs=body.top_logprobs if body.wants_logprobs
        else None,
        tools=[_tool(t) for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(text.format) if text else None,
        verbosity=text.verbosity if text else None,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        metadata=body.metadata, service_tier=body.service_tier,
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention,
        safety_identifier=body.safety_identifier)
    chat._turn = turn
    return chat


def _tool(tool: FunctionTool) -> Tool:
    return Tool(type="function", function=tool.definition)


def _tool_choice(choice) -> str | NamedToolChoice | None:
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return choice


def _response_format(text_format) -> JsonObjectFormat | JsonSchemaFormat | None:
    if isinstance(text_format, TextFormatJsonObject):
        return JsonObjectFormat(type="json_object")
    if isinstance(text_format, TextFormatJsonSchema):
        spec = JsonSchemaSpec.model_validate({
            "name": text_format.name, "description": text_format.description,
            "schema": text_format.schema_, "strict": text_format.strict})
        return JsonSchemaFormat(type="json_schema", json_schema=spec)
    return None
