"""Chat messages to template form: roles, content parts, tool fields, errors."""

from __future__ import annotations

import pytest

from conveyor.tokenizer.conversation import ChatMessage, ContentPart, template_messages
from conveyor.tokenizer.errors import InvalidRequest


def test_roles_and_developer_alias():
    messages = [ChatMessage("developer", "rules"), ChatMessage("user", "hi"),
                ChatMessage("assistant", "yo"), ChatMessage("tool", "42", tool_call_id="c1")]
    out = template_messages(messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_text_parts_are_concatenated_in_order_and_replace_content():
    parts = (ContentPart("text", "one "), ContentPart("text", "two"))
    assert template_messages([ChatMessage("user", "ignored", parts)])[0]["content"] == "one two"


def test_tool_calls_and_name_are_passed_on():
    message = ChatMessage("assistant", "", name="bot",
                          tool_calls_json='[{"id": "c1", "type": "function"}]')
    out = template_messages([message])[0]
    assert out["name"] == "bot" and out["tool_calls"] == [{"id": "c1", "type": "function"}]


@pytest.mark.parametrize("messages, message", [
    ([], "messages is empty; send at least one message"),
    ([ChatMessage("robot", "x")],
     "messages[0].role 'robot' is not one of system, user, assistant, tool, developer"),
    ([ChatMessage("user", "", (ContentPart("", "x"),))],
     "messages[0].content[0] has no type; content parts need type 'text'"),
    ([ChatMessage("user", "a"), ChatMessage("user", "", (ContentPart("text", "a"),
                                                         ContentPart("image_url"),))],
     "messages[1].content[1] has type 'image_url'; only 'text' content parts are supported"),
    ([ChatMessage("assistant", "", tool_calls_json="[{")],
     "messages[0].tool_calls is not valid JSON"),
    ([ChatMessage("assistant", "", tool_calls_json='{"id": 1}')],
     "messages[0].tool_calls must be a JSON array, got dict"),
])
def test_bad_messages(messages, message):
    with pytest.raises(InvalidRequest) as caught:
        template_messages(messages)
    assert str(caught.value).startswith(message)
