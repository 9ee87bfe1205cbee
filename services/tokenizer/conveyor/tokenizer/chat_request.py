"""A Render request in domain form, and the template arguments it implies."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.tokenizer.conversation import ChatMessage, parse_json, template_messages
from conveyor.tokenizer.errors import InvalidRequest

RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
"""chat_template_kwargs names that the request sets through its own fields."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """Render a conversation with the chat template, then tokenize it."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str = ""
    """Overrides the model's template when non-empty."""
    tools_json: str = ""
    chat_template_kwargs_json: str = ""
    documents_json: str = ""
    max_tokens: int = 0
    max_model_len: int | None = None
    """The context length to check against (the engines'); None: the model's own."""
    truncate_prompt_tokens: int | None = None
    """Keep only the rendered prompt's last k tokens (-1: the last max_model_len)."""
    bad_words: tuple[str, ...] = ()
    """vLLM's bad_words, tokenized with the prompt (TokenizedPrompt.bad_words)."""

    @property
    def num_chars(self) -> int:
        """Characters of text the request carries, before rendering."""
        return (sum(m.num_chars for m in self.messages) + len(self.chat_template)
                + len(self.tools_json) + len(self.chat_template_kwargs_json)
                + len(self.documents_json))


@dataclass(frozen=True, slots=True)
class TemplateArguments:
    """What `apply_chat_template` receives for one request, validated."""

    conversation: list[dict]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None = None
    tools: list | None = None
    documents: list[dict] | None = None
    kwargs: dict = field(default_factory=dict)


def template_arguments(request: ChatRequest) -> TemplateArguments:
    """Validate the request and turn it into template arguments (InvalidRequest on bad input)."""
    if request.add_generation_prompt and request.continue_final_message:
        raise InvalidRequest(
            "add_generation_prompt and continue_final_message cannot both be set: either start "
            "a new assistant message or continue the final one")
    return TemplateArguments(
        conversation=template_messages(request.messages),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template or None,
        tools=_tools(request.tools_json),
        documents=_documents(request.documents_json),
        kwargs=_kwargs(request.chat_template_kwargs_json),
    )


def _tools(tools_json: str) -> list | None:
    if not tools_json:
        return None
    tools = parse_json(tools_json, list, "tools")
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{index}] must be a JSON object")
    return tools


def _documents(documents_json: str) -> list[dict] | None:
    if not documents_json:
        return None
    documents = parse_json(documents_json, list, "documents")
    for index, document in enumerate(documents):
        if not isinstance(document, dict) or not all(isinstance(v, str)
                                                     for v in document.values()):
            raise InvalidRequest(f"documents[{index}] must be a JSON object of strings")
    return documents


def _kwargs(kwargs_json: str) -> dict:
    if not kwargs_json:
        return {}
    kwargs = parse_json(kwargs_json, dict, "chat_template_kwargs")
    clashes = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if clashes:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(clashes)}; use the request's own fields")
    return kwargs
