"""Chat templates: a conversation in, the prompt text out."""

from __future__ import annotations

import jinja2

from conveyor.tokenizer.chat_request import TemplateArguments
from conveyor.tokenizer.documents_prompt import template_knows_documents, with_documents_in_text
from conveyor.tokenizer.errors import InvalidRequest
from conveyor.tokenizer.tool_prompt import (
    needs_tool_text,
    template_knows_tools,
    with_tools_in_text,
)


class ChatRenderer:
    """Renders conversations with the model's chat template (or a request's own).

    A template that never mentions tools gets the request's tools and tool turns
    written into the conversation's text (tool_prompt.py), so none is dropped; so do
    its documents in one that never mentions them (documents_prompt.py).
    Any failure while rendering is the request's fault (its template, its
    messages or its kwargs), so every one becomes InvalidRequest; the message
    says whose template failed and why.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    @property
    def has_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def render(self, args: TemplateArguments) -> str:
        """The prompt text of `args` (blocking: call it off the event loop)."""
        if args.chat_template is None and not self.has_template:
            raise InvalidRequest("this model has no chat template; pass chat_template")
        conversation, tools = args.conversation, args.tools
        template = args.chat_template or self._tokenizer.chat_template
        if not template_knows_tools(template) and needs_tool_text(conversation, tools):
            conversation, tools = with_tools_in_text(conversation, tools), None
        documents = args.documents
        if documents and not template_knows_documents(template):
            conversation, documents = with_documents_in_text(conversation, documents), None
        try:
            return self._tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents,
                chat_template=args.chat_template,
                add_generation_prompt=args.add_generation_prompt,
                continue_final_message=args.continue_final_message, tokenize=False,
                **args.kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - any template failure is bad input
            raise InvalidRequest(self._explain(args, exc)) from None

    @staticmethod
    def _explain(args: TemplateArguments, exc: Exception) -> str:
        whose = "the request's chat_template" if args.chat_template else "the chat template"
        if isinstance(exc, jinja2.TemplateSyntaxError):
            return f"{whose} is not valid Jinja (line {exc.lineno}): {exc.message}"
        if isinstance(exc, jinja2.TemplateError):
            return f"{whose} failed to render: {exc}"
        return f"{whose} failed to render these messages: {type(exc).__name__}: {exc}"
