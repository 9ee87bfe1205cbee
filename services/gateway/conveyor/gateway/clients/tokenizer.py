"""The tokenizer's client: unary calls (render, tokenize, decode, info) to its replicas,
a call a replica fails to answer retried on another (ReplicaSet.call); the records it
sends and reads, and their one conversion to and from protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.common.replica_set import ReplicaSet
from conveyor.gateway.clients.upstream import translate_rpc_errors
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc

# -- records -----------------------------------------------------------------------------

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
    max_model_len: int = 0
    """The context length to check prompt + max_tokens against (the engines', as the
    served model has it); 0: the model's own."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str = ""
    tools_json: str = ""
    chat_template_kwargs_json: str = ""
    documents_json: str = ""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens (-1: the last max_model_len); None: all."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's bad_words, tokenized with the prompt (PromptTokens.bad_words)."""


@dataclass(slots=True)
class PromptInput:
    """A plain prompt: text or token ids (exactly one of them)."""

    text: str | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    max_tokens: int = 0
    max_model_len: int = 0
    """As RenderInput's."""
    truncate_prompt_tokens: int | None = None
    """As RenderInput's."""
    bad_words: list[str] = field(default_factory=list)
    """As RenderInput's."""


@dataclass(slots=True)
class PromptTokens:
    """A tokenized prompt and the context length it was checked against."""

    token_ids: list[int]
    prompt_text: str
    max_model_len: int
    bad_words: list[list[int]] = field(default_factory=list)
    """The token sequences of the request's bad_words (the tokenizer's)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class TokenizerFacts:
    """What the tokenizer serves (Tokenizer.Info)."""

    model: str
    vocab_size: int
    max_model_len: int
    """The model's own (engines may serve a shorter one: ServedModel has theirs)."""
    eos_token_ids: list[int]


# -- client ------------------------------------------------------------------------------

TOKENIZER_SERVICE = "tokenizer"


class TokenizerClient:
    """Unary calls to the tokenizer replicas, each with a deadline."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    async def render(self, render: RenderInput) -> PromptTokens:
        return prompt_tokens(await self._call("Render", render_request(render)))

    async def tokenize(self, prompt: PromptInput) -> PromptTokens:
        return prompt_tokens(
            await self._call("Tokenize", tokenize_request(prompt)))

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        reply = await self._call("Decode", decode_request(token_ids, skip_special_tokens))
        return reply.text

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token string from the vocabulary (vLLM's /tokenize token_strs)."""
        reply = await self._call("Decode", tokenizer_pb2.DecodeRequest(
            token_ids=token_ids, token_strings=True))
        return list(reply.token_strings)

    async def info(self) -> TokenizerFacts:
        return tokenizer_facts(
            await self._call("Info", tokenizer_pb2.TokenizerInfoRequest()))

    async def is_serving(self) -> bool:
        return await self._replicas.is_serving(self._timeout_s)

    async def close(self) -> None:
        await self._replicas.close()

    async def _call(self, method: str, request):
        """`method` on one replica, on another when that one does not answer."""
        async def on(channel):
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            return await getattr(stub, method)(request, timeout=self._timeout_s)

        with translate_rpc_errors(TOKENIZER_SERVICE):
            return await self._replicas.call(on)


# -- protobuf ----------------------------------------------------------------------------

def render_request(render: RenderInput) -> tokenizer_pb2.RenderRequest:
    return tokenizer_pb2.RenderRequest(
        messages=[_chat_message(m) for m in render.messages],
        add_generation_prompt=render.add_generation_prompt,
        continue_final_message=render.continue_final_message,
        chat_template=render.chat_template,
        tools_json=render.tools_json,
        max_tokens=render.max_tokens,
        chat_template_kwargs_json=render.chat_template_kwargs_json,
        max_model_len=render.max_model_len,
        truncate_prompt_tokens=render.truncate_prompt_tokens,
        documents_json=render.documents_json,
        bad_words=render.bad_words,
    )


def _chat_message(turn: ChatTurn) -> tokenizer_pb2.ChatMessage:
    return tokenizer_pb2.ChatMessage(
        role=turn.role,
        content=turn.content,
        parts=[tokenizer_pb2.ContentPart(type="text", text=text) for text in turn.parts],
        name=turn.name,
        tool_call_id=turn.tool_call_id,
        tool_calls_json=turn.tool_calls_json,
    )


def tokenize_request(prompt: PromptInput) -> tokenizer_pb2.TokenizeRequest:
    request = tokenizer_pb2.TokenizeRequest(
        add_special_tokens=prompt.add_special_tokens, max_tokens=prompt.max_tokens,
        max_model_len=prompt.max_model_len, truncate_prompt_tokens=prompt.truncate_prompt_tokens,
        bad_words=prompt.bad_words,
    )
    if prompt.token_ids is not None:
        request.token_ids.ids.extend(prompt.token_ids)
    else:
        request.text = prompt.text or ""
    return request


def prompt_tokens(message: tokenizer_pb2.TokenizeResponse) -> PromptTokens:
    return PromptTokens(
        token_ids=list(message.token_ids),
        prompt_text=message.prompt_text,
        max_model_len=message.max_model_len,
        bad_words=[list(sequence.ids) for sequence in message.bad_words],
    )


def decode_request(token_ids: list[int], skip_special_tokens: bool) -> tokenizer_pb2.DecodeRequest:
    return tokenizer_pb2.DecodeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)


def tokenizer_facts(message: tokenizer_pb2.TokenizerInfo) -> TokenizerFacts:
    return TokenizerFacts(
        model=message.model,
        vocab_size=message.vocab_size,
        max_model_len=message.max_model_len,
        eos_token_ids=list(message.eos_token_ids),
    )
