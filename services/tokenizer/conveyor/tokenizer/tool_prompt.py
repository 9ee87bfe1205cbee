"""Tools for a model whose chat template has no place for them, written into the text.

Some chat templates (the bundled SmolLM2's among them) never mention tools: rendered
as they are, a request's tools and its tool turns would silently vanish. For such a
template the conversation is rewritten first, in the Hermes convention that the
gateway's default tool-call parser reads back:

- the tools are described in the system message (one is added when there is none),
  with the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form to call them;
- an assistant turn's tool_calls become such blocks after its content;
- a tool turn's content is wrapped in `<tool_response>...</tool_response>`.

A template that mentions tools renders the conversation untouched.
"""

from __future__ import annotations

import json

from conveyor.tokenizer.conversation import with_system_text

INSTRUCTIONS = (
    "You can call functions to help with the user's request. The functions are described "
    "as JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>\nAnswer in plain text when no function is needed."
)


def template_knows_tools(template: str | dict) -> bool:
    """Whether a chat template's source handles tools (mentions them at all)."""
    return "tool" in str(template)


def needs_tool_text(conversation: list[dict], tools: list | None) -> bool:
    """Whether the request carries tools or tool turns that a tool-less template drops."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)


def with_tools_in_text(conversation: list[dict], tools: list | None) -> list[dict]:
    """The conversation with its tools and tool turns written as text (see the module doc)."""
    messages = [_as_text(message) for message in conversation]
    if not tools:
        return messages
    return with_system_text(messages, INSTRUCTIONS.format(
        tools="\n".join(json.dumps(t) for t in tools)))


def _as_text(message: dict) -> dict:
    if message["role"] == "tool":
        return {**message,
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [_call_block(call) for call in calls]
    content = "\n".join([message["content"], *blocks] if message["content"] else blocks)
    return {"role": message["role"], "content": content}


def _call_block(call: dict) -> str:
    """`<tool_call>` text of one OpenAI tool call ({"function": {"name", "arguments"}})."""
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # shown as the string it is
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"
