"""The parts of a chat body about its messages, structured outputs and tools (mapped to the
engine's constraint and detok's tool-call reading by output_constraints.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from conveyor.gateway.api.fields import BodyPart, unsupported


class JsonSchemaSpec(BodyPart):
    """response_format.json_schema: the schema the output must match."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """OpenAI's flag; the schema is enforced by constrained decoding whether set or not."""


class TextFormat(BodyPart):
    type: Literal["text"]


class JsonObjectFormat(BodyPart):
    type: Literal["json_object"]


class JsonSchemaFormat(BodyPart):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatField = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                                Field(discriminator="type")]


class StructuredOutputsParams(BodyPart):
    """vLLM's `structured_outputs`: exactly one kind. Its other options (whitespace,
    structural tags, backends) are refused as unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(BodyPart):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BodyPart):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BodyPart):
    name: str = Field(min_length=1)


class NamedToolChoice(BodyPart):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextPart(BodyPart):
    type: Literal["text"]
    text: str


class RefusalPart(BodyPart):
    """An assistant's earlier refusal, fed back: rendered as its text."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class ChatMessage(BodyPart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    """An assistant's earlier refusal (as the SDK returns it): its text when content is empty."""
    annotations: list[dict[str, Any]] | None = None
    """Citations of an earlier answer, fed back: no effect (the model reads the text)."""
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _no_audio_or_functions(self):
        if self.audio is not None:
            raise unsupported("messages.audio", "this model reads and writes text only")
        if self.function_call is not None:
            raise unsupported("messages.function_call",
                              "the deprecated functions API; send tool_calls")
        return self

    @property
    def text_parts(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.text if isinstance(p, TextPart) else p.refusal for p in self.content]

    @property
    def text(self) -> str:
        """The content when it is a string, else the refusal's text (or "")."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            return self.refusal or ""
        return ""
