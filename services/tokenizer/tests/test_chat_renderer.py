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


def test_tool_role_renders(tokenizer):
    messages = [*USER_HI, ChatMessage("tool", "72F", tool_call_id="c1")]
    assert "<|im_start|>tool\n72F<|im_end|>\n" in render(tokenizer, messages=messages)


def test_request_template_sees_tools_and_kwargs(tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ greeting }}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
    text = render(tokenizer, messages=USER_HI, chat_template=template,
                  tools_json='[{"type": "function", "function": {"name": "weather"}}]',
                  chat_template_kwargs_json='{"greeting": "hey "}')
    assert text == "[weather]hey user:Hi"


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
    ({"chat_template_kwargs_json": '{"tokenize": true, "messages": []}'},
     "chat_template_kwargs may not set messages, tokenize"),
])
def test_template_and_argument_errors_are_invalid_requests(tokenizer, fields, message):
    with pytest.raises(InvalidRequest) as caught:
        render(tokenizer, messages=USER_HI, **fields)
    assert str(caught.value).startswith(message)
