"""What the gateway sends to and reads from the tokenizer, as plain data (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ChatTurn:
    """One chat message; `parts` (text pieces) win over `content` when given."""

    role: str
    content: str = ""
    parts: list[str] = field(default_factory=list)
    name: str = ""
    tool_call_id: str = ""
    tool_calls_json: str = ""


@dataclass(slots=True)
class RenderInput:
    """A conversation to render with the chat template and tokenize."""

    messages: list[ChatTurn]
    max_tokens: int = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str = ""
    tools_json: str = ""
    chat_template_kwargs_json: str = ""


@dataclass(slots=True)
class PromptInput:
    """A plain prompt: text or token ids (exactly one of them)."""

    text: str | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    max_tokens: int = 0


@dataclass(slots=True)
class PromptTokens:
    """A tokenized prompt and the model's context length."""

    token_ids: list[int]
    prompt_text: str
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class TokenizerFacts:
    """What the tokenizer serves (Tokenizer.Info)."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
