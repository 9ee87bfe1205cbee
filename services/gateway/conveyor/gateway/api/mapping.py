"""From a validated body to what the services get: the engine's sampling options and
detok's options (`sampling_options`, `detok_options`, `max_tokens_for`, `check_limits`),
the tokenizer's input (`render_input`), and what its response shows (`output_options`)."""

from __future__ import annotations

import json
from dataclasses import replace

from conveyor.common.sampling_fields import KNOBS
from conveyor.gateway.api.fields import StreamOptions
from conveyor.gateway.api.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from conveyor.gateway.api.tools import ChatMessage
from conveyor.gateway.clients.detok import DetokOptions, ToolCallParsing
from conveyor.gateway.clients.engine import SamplingOptions
from conveyor.gateway.clients.tokenizer import ChatTurn, PromptTokens, RenderInput
from conveyor.gateway.errors import bad_request, context_length_exceeded
from conveyor.gateway.models import ServedModel
from conveyor.gateway.response_formats import OutputOptions

GenerationBody = ChatCompletionRequest | CompletionRequest


def check_limits(body: GenerationBody, model: ServedModel, max_n: int) -> None:
    """400 for values only the served model can judge (token ids, n)."""
    if body.n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {body.n}", "n")
    for token_id in body.stop_token_ids or []:
        _check_token_id(token_id, model, "stop_token_ids")
    allowed = body.allowed_token_ids or []
    if len(allowed) > model.vocab_size:
        raise bad_request(f"allowed_token_ids holds {len(allowed)} ids; the vocabulary has "
                          f"{model.vocab_size}", "allowed_token_ids")
    for token_id in allowed:
        _check_token_id(token_id, model, "allowed_token_ids")
    for key in body.logit_bias or {}:
        _check_token_id(int(key), model, "logit_bias")


def _check_token_id(token_id: int, model: ServedModel, param: str) -> None:
    if token_id >= model.vocab_size:
        raise bad_request(
            f"token id {token_id} is outside the vocabulary (size {model.vocab_size})", param
        )


def max_tokens_for(requested: int | None, prompt: PromptTokens, prompt_param: str) -> int:
    """What the engine may generate: the request's max_tokens, or by default what the
    context has left (max_model_len - prompt length, as vLLM does)."""
    room = prompt.max_model_len - prompt.num_tokens
    if requested is None and room < 1:
        raise context_length_exceeded(
            f"This model's maximum context length is {prompt.max_model_len} tokens. "
            f"However, your prompt has {prompt.num_tokens} tokens, leaving no room for output.",
            prompt_param,
        )
    return requested if requested is not None else room


def sampling_options(body: GenerationBody, max_tokens: int,
                     bad_words: list[list[int]] | None = None) -> SamplingOptions:
    """The engine's sampling controls for the body's n samples of one prompt (the engine
    gives sample i the seed + i); `bad_words`: the tokenizer's sequences of its bad_words."""
    logprobs, top_logprobs = _logprob_request(body)
    knobs = {knob.name: getattr(body, knob.name) for knob in KNOBS}
    return SamplingOptions(
        max_tokens=max_tokens,
        knobs={name: value for name, value in knobs.items() if value is not None},
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        stop_token_ids=list(body.stop_token_ids or []),
        allowed_token_ids=list(body.allowed_token_ids or []),
        bad_words=bad_words or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_tokens=body.min_tokens,
        prompt_logprobs=body.engine_prompt_logprobs,
    )


def output_options(body: GenerationBody) -> OutputOptions:
    """What the body asks of its response beyond the choices' text and logprobs."""
    stream_options = body.stream_options or StreamOptions()
    return OutputOptions(
        n=body.n, include_usage=stream_options.include_usage,
        continuous_usage=stream_options.continuous_usage_stats,
        obfuscate=stream_options.include_obfuscation,
        served_tier=body.served_tier,
        num_prompt_logprobs=body.prompt_logprobs,
        token_ids=body.return_token_ids,
        echo=isinstance(body, CompletionRequest) and body.echo,
        chat_echo=body.echoed_text if isinstance(body, ChatCompletionRequest) else "")


def num_top_logprobs(body: GenerationBody) -> int | None:
    """How many alternatives each logprobs entry shows; None when logprobs are off."""
    logprobs, top_logprobs = _logprob_request(body)
    return top_logprobs if logprobs else None


def _logprob_request(body: GenerationBody) -> tuple[bool, int]:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs, body.top_logprobs or 0
    return body.logprobs is not None, body.logprobs or 0


def detok_options(body: GenerationBody, request_id: str,
                  tool_calls: ToolCallParsing | None = None) -> DetokOptions:
    return DetokOptions(
        request_id=request_id,
        stop=body.stop_strings,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        tool_calls=tool_calls,
    )


def render_input(body: ChatCompletionRequest, max_tokens: int | None,
                 model: ServedModel) -> RenderInput:
    """The conversation to render, checked against `model`'s max_model_len."""
    return replace(conversation_input(body, model), max_tokens=max_tokens or 0,
                   truncate_prompt_tokens=body.truncate_prompt_tokens,
                   bad_words=list(body.bad_words or []))


def conversation_input(body: ChatCompletionRequest | TokenizeRequest,
                       model: ServedModel) -> RenderInput:
    """What the chat template renders (the fields chat and /tokenize share)."""
    return RenderInput(
        messages=chat_turns(body.messages),
        max_model_len=model.max_model_len,
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template or "",
        tools_json=json.dumps([t.model_dump(exclude_none=True, by_alias=True)
                               for t in body.tools]) if body.tools else "",
        chat_template_kwargs_json=(
            json.dumps(body.chat_template_kwargs) if body.chat_template_kwargs else ""
        ),
        documents_json=json.dumps(body.documents) if body.documents else "",
    )


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    return [
        ChatTurn(
            role=m.role,
            content=m.text,
            parts=m.text_parts,
            name=m.name or "",
            tool_call_id=m.tool_call_id or "",
            tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
        )
        for m in messages
    ]
