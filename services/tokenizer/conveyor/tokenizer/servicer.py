"""The Tokenizer gRPC servicer: converts proto messages to and from domain
types (nothing past this file imports *_pb2) and maps errors to statuses."""

from __future__ import annotations

from collections.abc import Awaitable

import grpc

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.tokenizer.chat_request import ChatRequest
from conveyor.tokenizer.conversation import ChatMessage, ContentPart
from conveyor.tokenizer.errors import ContextLengthExceeded, InvalidRequest, TextTooLong
from conveyor.tokenizer.prompt import TextPrompt, TokenIdsPrompt, TokenizedPrompt
from conveyor.tokenizer.prompt_service import PromptService
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Render, Tokenize, Decode and Info over a PromptService.

    Bad input aborts with INVALID_ARGUMENT; the trailing metadata key
    `conveyor-error-reason` says `context_length_exceeded` (the message names
    prompt_len, max_tokens and max_model_len, or the characters past the text limit) or
    `invalid_request`.
    """

    def __init__(self, service: PromptService):
        self._service = service

    async def Render(self, request, context):
        prompt = await _or_abort(context, self._service.render(_chat_request(request)))
        return _tokenized(prompt)

    async def Tokenize(self, request, context):
        prompt = await _or_abort(context, self._tokenize(request))
        return _tokenized(prompt)

    async def Decode(self, request, context):
        if request.token_strings:
            strings = await _or_abort(context, self._service.token_strings(
                list(request.token_ids)))
            return tokenizer_pb2.DecodeResponse(token_strings=strings)
        if request.each_token:
            texts = await _or_abort(context, self._service.decode_each(
                list(request.token_ids), request.skip_special_tokens))
            return tokenizer_pb2.DecodeResponse(token_texts=texts)
        text = await _or_abort(context, self._service.decode(
            list(request.token_ids), request.skip_special_tokens))
        return tokenizer_pb2.DecodeResponse(text=text)

    async def Info(self, request, context):
        info = self._service.info
        bos = info.facts.bos_token_id
        return tokenizer_pb2.TokenizerInfo(
            model=info.model, vocab_size=info.facts.vocab_size,
            max_model_len=info.max_model_len, eos_token_ids=list(info.facts.eos_token_ids),
            bos_token_id=bos or 0, has_bos=bos is not None,
        )

    async def _tokenize(self, request) -> TokenizedPrompt:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt is missing; set text or token_ids")
        max_model_len = request.max_model_len or None
        keep = _truncation(request)
        if which == "token_ids":
            prompt = TokenIdsPrompt(list(request.token_ids.ids), request.max_tokens,
                                    max_model_len, keep, tuple(request.bad_words))
        else:
            prompt = TextPrompt(request.text, request.add_special_tokens, request.max_tokens,
                                max_model_len, keep, tuple(request.bad_words))
        return await self._service.tokenize(prompt)


async def _or_abort(context, work: Awaitable):
    """Await the domain call; turn InvalidRequest into INVALID_ARGUMENT with a reason."""
    try:
        return await work
    except InvalidRequest as exc:
        too_long = isinstance(exc, ContextLengthExceeded | TextTooLong)
        reason = CONTEXT_LENGTH_EXCEEDED if too_long else INVALID_REQUEST
        context.set_trailing_metadata(((ERROR_REASON_KEY, reason),))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _chat_request(request) -> ChatRequest:
    return ChatRequest(
        messages=[_message(m) for m in request.messages],
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template,
        tools_json=request.tools_json,
        chat_template_kwargs_json=request.chat_template_kwargs_json,
        documents_json=request.documents_json,
        max_tokens=request.max_tokens,
        max_model_len=request.max_model_len or None,
        truncate_prompt_tokens=_truncation(request),
        bad_words=tuple(request.bad_words),
    )


def _truncation(request) -> int | None:
    """truncate_prompt_tokens (None when unset)."""
    if not request.HasField("truncate_prompt_tokens"):
        return None
    return request.truncate_prompt_tokens


def _message(message) -> ChatMessage:
    return ChatMessage(
        role=message.role, content=message.content,
        parts=tuple(ContentPart(p.type, p.text) for p in message.parts),
        name=message.name, tool_call_id=message.tool_call_id,
        tool_calls_json=message.tool_calls_json,
    )


def _tokenized(prompt: TokenizedPrompt):
    return tokenizer_pb2.TokenizeResponse(
        token_ids=prompt.token_ids, prompt_text=prompt.prompt_text,
        num_tokens=prompt.num_tokens, max_model_len=prompt.max_model_len,
        bad_words=[tokenizer_pb2.TokenIds(ids=ids) for ids in prompt.bad_words],
    )
