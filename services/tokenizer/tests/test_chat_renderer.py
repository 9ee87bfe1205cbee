"""Rendering with the real SmolLM2 chat template, overrides, tools and template errors."""

from __future__ import annotations

import pytest

from conveyor.tokenizer.chat_renderer import ChatRenderer
from conveyor.tokenizer.chat_request import ChatRequest, template_arguments
from conveyor.tokenizer.conversation import ChatMessage
from conveyor.tokenizer.errors import InvalidRequest

DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
USER_HI = [ChatMessage("user", "Hi")]


def render(tokenizer, **fields) -> str:
    return ChatRenderer(tokenizer).render(template_arguments(ChatRequest(**fields)))


def test_default_system_prompt_and_generation_prompt(tokenizer):
    text = render(tokenizer, messages=USER_HI, add_generation_prompt=True)
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_own_system_message_replaces_the_default(tokenizer):
    text = render(tokenizer, messages=[ChatMessage("developer", "Be brief."), *USER_HI])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    messages = [*USER_HI, ChatMessage("assistant", "Hello, I am")]
    text = render(tokenizer, messages=messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I am")


def test_tool_role_renders_as_a_tool_response(tokenizer):
    messages = [*USER_HI, ChatMessage("tool", "72F", tool_call_id="c1")]
    assert ("<|im_start|>tool\n<tool_response>\n72F\n</tool_response><|im_end|>\n"
            in render(tokenizer, messages=messages))


WEATHER_TOOL = ('[{"type": "function", "function": {"name": "get_weather", '
                '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]')


def test_tools_are_described_in_the_system_message_of_a_template_without_tools(tokenizer):
    text = render(tokenizer, messages=USER_HI, tools_json=WEATHER_TOOL,
                  add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '{"name": "get_weather", "parameters"' in text and "<tool_call>" in text
    assert "named SmolLM" not in text  # the tools' system message replaces the default
    own = render(tokenizer, messages=[ChatMessage("system", "Be brief."), *USER_HI],
                 tools_json=WEATHER_TOOL)
    assert own.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")


def test_assistant_tool_calls_are_written_as_tool_call_blocks(tokenizer):
    calls = ('[{"id": "call_1", "type": "function", "function": {"name": "get_weather", '
             '"arguments": "{\\"city\\": \\"Paris\\"}"}}]')
    messages = [*USER_HI, ChatMessage("assistant", "", tool_calls_json=calls),
                ChatMessage("tool", "18C", tool_call_id="call_1")]
    text = render(tokenizer, messages=messages, tools_json=WEATHER_TOOL)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_request_template_sees_tools_and_kwargs(tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ greeting }}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
    text = render(tokenizer, messages=USER_HI, chat_template=template,
                  tools_json='[{"type": "function", "function": {"name": "weather"}}]',
                  chat_template_kwargs_json='{"greeting": "hey "}')
    assert text == "[weather]hey user:Hi"


DOCS = '[{"title": "Tides", "text": "The moon pulls the sea."}]'


def test_documents_go_into_the_system_message_of_a_template_without_them(tokenizer):
    text = render(tokenizer, messages=USER_HI, documents_json=DOCS)
    assert text.startswith("<|im_start|>system\nUse these documents to answer:\n<documents>\n"
                           "<document>\ntitle: Tides\ntext: The moon pulls the sea.\n"
                           "</document>\n</documents><|im_end|>\n")
    own = render(tokenizer, messages=[ChatMessage("system", "Be brief."), *USER_HI],
                 documents_json=DOCS)
    assert own.startswith("<|im_start|>system\nBe brief.\n\nUse these documents")


def test_a_template_that_reads_documents_gets_them(tokenizer):
    template = ("{% for d in documents %}({{ d.title }}: {{ d.text }}){% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
    text = render(tokenizer, messages=USER_HI, chat_template=template, documents_json=DOCS)
    assert text == "(Tides: The moon pulls the sea.)user:Hi"


@pytest.mark.parametrize("fields, message", [
    ({"chat_template": "{% for m in messages %}"},
     "the request's chat_template is not valid Jinja (line 1)"),
    ({"chat_template": "{{ raise_exception('no users allowed') }}"},
     "the request's chat_template failed to render: no users allowed"),
    ({"chat_template": "{{ 1 / 0 }}"},
     "the request's chat_template failed to render these messages: ZeroDivisionError"),
    ({"add_generation_prompt": True, "continue_final_message": True},
     "add_generation_prompt and continue_final_message cannot both be set"),
    ({"tools_json": "[1]"}, "tools[0] must be a JSON object"),
    ({"tools_json": "{"}, "tools is not valid JSON"),
    ({"chat_template_kwargs_json": "[]"}, "chat_template_kwargs must be a JSON object, got list"),
    ({"documents_json": '[{"text": 1}]'}, "documents[0] must be a JSON object of strings"),
    ({"documents_json": '{"text": "x"}'}, "documents must be a JSON array"),
    ({"chat_template_kwargs_json": '{"tokenize": true, "messages": []}'},
     "chat_template_kwargs may not set messages, tokenize"),
])
def test_template_and_argument_errors_are_invalid_requests(tokenizer, fields, message):
    with pytest.raises(InvalidRequest) as caught:
        render(tokenizer, messages=USER_HI, **fields)
    assert str(caught.value).startswith(message)
