"""What a client may send to POST /v1/responses, checked on arrival.

Every field of the openai SDK's ResponseCreateParams is declared: honoured, without
effect by its own definition for this model (reasoning, text.verbosity, max_tool_calls,
which counts built-in tool calls and there are none), or refused with a 400 naming it
when set to what this server cannot do (background options, prompt templates, hosted tools,
media input, ...). A field in no schema is a 400
naming it, as for chat (docs/api.md lists them all).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    field_validator,
    model_validator,
)

from conveyor.common.sampling_fields import KNOBS, MAX_TOP_LOGPROBS
from conveyor.gateway.api.fields import (
    BodyPart,
    TokenCount,
    invalid,
    refuse_set_fields,
    unsupported,
)
from conveyor.gateway.api.schemas import OpenAIOptions, ReasoningEffort, Verbosity, knob_field
from conveyor.gateway.api.tools import FunctionDefinition

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value served: the output text's logprobs."""

# -- input items -------------------------------------------------------------------------

class InputText(BodyPart):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Any = None
    """OpenAI's explicit cache breakpoint: no effect (the prefix cache is automatic)."""


class OutputText(BodyPart):
    """An earlier answer's text, fed back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(BodyPart):
    type: Literal["refusal"]
    refusal: str


class MediaPart(BodyPart):
    """An image, file or audio part: refused (the model reads text only)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refused(self):
        raise unsupported("input.type", "this model reads text only", what=self.type)


ContentPart = Annotated[InputText | OutputText | Refusal | MediaPart,
                        Field(discriminator="type")]


def _text_of(content: str | list[ContentPart]) -> str:
    """A message's (or a function output's) text: its parts' texts, joined."""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


class MessageItem(BodyPart):
    """A message: the caller's (user, system, developer) or an earlier answer (assistant)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    """A label of an assistant message's phase: no effect."""

    @property
    def text(self) -> str:
        return _text_of(self.content)


class FunctionCallItem(BodyPart):
    """A call the model made earlier, fed back with its output (function_call_output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BodyPart):
    """What the caller's function returned for call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return _text_of(self.output)


class ItemReference(BodyPart):
    """An item of a stored response, by id: refused (send previous_response_id)."""

    type: Literal["item_reference"]
    id: str

    @model_validator(mode="after")
    def _refused(self):
        raise unsupported("input.type", "send the item itself, or previous_response_id to "
                          "continue a stored response", what="item_reference")


def _item_type(item: Any) -> str:
    """An item's type; a message may leave it out (OpenAI's EasyInputMessage)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(_item_type),
]


# -- tools, text format, options -----------------------------------------------------------

class FunctionTool(FunctionDefinition):
    """A function tool, in the Responses API's flat shape (chat's definition, typed)."""

    type: Literal["function"]

    @property
    def definition(self) -> FunctionDefinition:
        return FunctionDefinition(name=self.name, description=self.description,
                                  parameters=self.parameters, strict=self.strict)


class FunctionChoice(BodyPart):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormatText(BodyPart):
    type: Literal["text"]


class TextFormatJsonObject(BodyPart):
    type: Literal["json_object"]


class TextFormatJsonSchema(BodyPart):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                       Field(discriminator="type")]


class TextConfig(BodyPart):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None
    """No effect: the served model was not trained to follow it."""


class Reasoning(BodyPart):
    """No effect: the served model does no reasoning (so it has no summary either)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class BackgroundOptions(BodyPart):
    """A background response's completion window: `soonest`, what is done (it runs at
    once); the discounted `2h` and `8h` windows and `continuation_id` are refused."""

    completion_window: Literal["soonest", "2h", "8h"] = "soonest"
    continuation_id: str | None = None


class ConversationRef(BodyPart):
    id: str = Field(min_length=1)


class ResponsesStreamOptions(BodyPart):
    include_obfuscation: bool = False
    """Text deltas carry an `obfuscation` field evening out their sizes (off unless asked)."""


_REFUSED = {
    "access_programs": "no access programs are served here",
    "context_management": "context compaction is not served",
    "image": "this model reads text only",
    "moderation": "no moderation model runs here",
    "prompt": "prompt templates are not served; send instructions and input",
    "prompt_cache_options": "the prefix cache is automatic: shared prompt prefixes are "
                            "reused while they stay in an engine's KV cache",
}
"""Fields of ResponseCreateParams this server refuses whenever they are set (not null)."""

_ResponsesKnobs = create_model(
    "_ResponsesKnobs", __base__=OpenAIOptions,
    **{knob.name: knob_field(knob) for knob in KNOBS if knob.name in ("temperature", "top_p")})
"""temperature and top_p, with the ranges the chat fields have."""


class ResponsesRequest(_ResponsesKnobs):
    """POST /v1/responses (metadata, service_tier, prompt_cache_key, prompt_cache_retention,
    safety_identifier, temperature and top_p as for chat)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: TokenCount | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    user: str | None = None
    reasoning: Reasoning | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    """No effect: it counts calls of built-in tools, and none are served."""
    truncation: Literal["auto", "disabled"] | None = None
    """"disabled" (the default): a conversation past the context is a 400; "auto": its oldest
    turns are dropped until it fits (responses/truncation.py)."""
    background: bool | None = None
    """Answer at once with the response `queued`; it is generated by this gateway replica
    (responses/background.py), read with GET and cancelled with POST .../cancel."""
    access_programs: Any = None
    background_options: BackgroundOptions | None = None
    context_management: Any = None
    conversation: str | ConversationRef | None = None
    """A conversation (the Conversations API) whose items come before the input; a complete
    response adds its input and output items to it."""
    image: Any = None
    moderation: Any = None
    prompt: Any = None
    prompt_cache_options: Any = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if value in ("", []):
            raise ValueError("input must not be empty")
        return value

    @model_validator(mode="after")
    def _refused_fields(self):
        refuse_set_fields(self, _REFUSED)
        if self.conversation is not None and self.previous_response_id is not None:
            raise invalid("conversation", "conversation and previous_response_id are mutually "
                          "exclusive: send one of them")
        if self.background and not self.store:
            raise invalid("background", "background responses are stored: store must be true")
        self._check_background_options()
        unknown = set(self.include or ()) - {LOGPROBS_INCLUDE}
        if unknown:
            raise unsupported("include", f"only {LOGPROBS_INCLUDE!r} is served, not "
                              f"{sorted(unknown)}")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if self.top_logprobs and not self.wants_logprobs:
            raise invalid("top_logprobs", f"top_logprobs requires include [{LOGPROBS_INCLUDE!r}]")
        return self

    def _check_background_options(self) -> None:
        options = self.background_options
        if options is None:
            return
        if not self.background:
            raise invalid("background_options", "background_options needs background true")
        if options.completion_window != "soonest":
            raise unsupported("background_options.completion_window", "the discounted 2h and "
                              "8h windows are not served: a background response runs at once "
                              "(soonest)")
        if options.continuation_id is not None:
            raise unsupported("background_options.continuation_id", "related background "
                              "requests are not prioritized together here")

    @property
    def conversation_id(self) -> str | None:
        conversation = self.conversation
        return conversation.id if isinstance(conversation, ConversationRef) else conversation

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())
