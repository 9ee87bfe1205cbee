"""The one place that converts between protobuf messages and the gateway's records.

Nothing else in the gateway imports `*_pb2`; the client modules hand records in
and get records back.
"""

from __future__ import annotations

from conveyor.common.engine_registry import EngineLoad
from conveyor.gateway.detok_records import DetokOptions, DetokReply, StopMatch
from conveyor.gateway.engine_records import (
    EngineChunk,
    EngineFacts,
    FinishReason,
    GenerateJob,
    PositionLogprobs,
    SamplingOptions,
    TokenUsage,
)
from conveyor.gateway.tokenizer_records import (
    ChatTurn,
    PromptInput,
    PromptTokens,
    RenderInput,
    TokenizerFacts,
)
from conveyor.v1 import detok_pb2, engine_pb2, tokenizer_pb2

_FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
)


# -- engine -----------------------------------------------------------------------------------

def generate_request(job: GenerateJob) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=job.request_id,
        prompt_token_ids=job.prompt_token_ids,
        sampling=sampling_params(job.sampling),
        priority=job.priority,
        cache_salt=job.cache_salt,
        resume_output_token_ids=job.resume_output_token_ids,
    )


def sampling_params(options: SamplingOptions) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        logit_bias=options.logit_bias,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        min_tokens=options.min_tokens,
    )
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(options, name)
        if value is not None:
            setattr(params, name, value)
    return params


def engine_chunk(message: engine_pb2.GenerateResponse) -> EngineChunk:
    return EngineChunk(
        token_ids=list(message.token_ids),
        logprobs=[_position_logprobs(p) for p in message.logprobs],
        finish_reason=_FINISH_REASONS.get(message.finish_reason),
        usage=TokenUsage(
            prompt_tokens=message.usage.prompt_tokens,
            completion_tokens=message.usage.completion_tokens,
            cached_tokens=message.usage.cached_tokens,
        ),
        stop_token_id=message.stop_token_id if message.HasField("stop_token_id") else None,
    )


def _position_logprobs(message: engine_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(
        logprob=message.logprob, top=[(t.token_id, t.logprob) for t in message.top]
    )


def stats_request() -> engine_pb2.EngineStatsRequest:
    return engine_pb2.EngineStatsRequest()


def engine_load(message: engine_pb2.EngineStats) -> EngineLoad:
    return EngineLoad(
        num_running=message.num_running,
        num_waiting=message.num_waiting,
        kv_usage=message.kv_usage,
        num_free_blocks=message.num_free_blocks,
        num_blocks=message.num_blocks,
    )


def engine_info_request() -> engine_pb2.EngineInfoRequest:
    return engine_pb2.EngineInfoRequest()


def engine_facts(message: engine_pb2.EngineInfo) -> EngineFacts:
    return EngineFacts(
        model=message.model, max_model_len=message.max_model_len, engine_id=message.engine_id
    )


# -- tokenizer --------------------------------------------------------------------------------

def render_request(render: RenderInput) -> tokenizer_pb2.RenderRequest:
    return tokenizer_pb2.RenderRequest(
        messages=[_chat_message(m) for m in render.messages],
        add_generation_prompt=render.add_generation_prompt,
        continue_final_message=render.continue_final_message,
        chat_template=render.chat_template,
        tools_json=render.tools_json,
        max_tokens=render.max_tokens,
        chat_template_kwargs_json=render.chat_template_kwargs_json,
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
        add_special_tokens=prompt.add_special_tokens, max_tokens=prompt.max_tokens
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
    )


def decode_request(token_ids: list[int], skip_special_tokens: bool) -> tokenizer_pb2.DecodeRequest:
    return tokenizer_pb2.DecodeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)


def decoded_text(message: tokenizer_pb2.DecodeResponse) -> str:
    return message.text


def tokenizer_info_request() -> tokenizer_pb2.TokenizerInfoRequest:
    return tokenizer_pb2.TokenizerInfoRequest()


def tokenizer_facts(message: tokenizer_pb2.TokenizerInfo) -> TokenizerFacts:
    return TokenizerFacts(
        model=message.model,
        vocab_size=message.vocab_size,
        max_model_len=message.max_model_len,
        eos_token_ids=list(message.eos_token_ids),
    )


# -- detok ------------------------------------------------------------------------------------

def detok_start(options: DetokOptions) -> detok_pb2.DetokenizeRequest:
    return detok_pb2.DetokenizeRequest(
        start=detok_pb2.DetokenizeStart(
            request_id=options.request_id,
            prompt_tail_token_ids=options.prompt_tail_token_ids,
            stop=options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
        )
    )


def detok_tokens(token_ids: list[int]) -> detok_pb2.DetokenizeRequest:
    return detok_pb2.DetokenizeRequest(token_ids=token_ids)


def detok_finish() -> detok_pb2.DetokenizeRequest:
    return detok_pb2.DetokenizeRequest(finish=True)


def detok_reply(message: detok_pb2.DetokenizeResponse) -> DetokReply:
    stop_match = None
    if message.HasField("stop_match"):
        match = message.stop_match
        stop_match = StopMatch(match.stop, match.stop_index, match.num_tokens)
    return DetokReply(
        text_delta=message.text_delta, num_tokens=message.num_tokens, stop_match=stop_match
    )
