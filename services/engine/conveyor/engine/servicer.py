"""The Engine gRPC service: the one place that converts between proto and engine types.

Generate: INVALID_ARGUMENT (with conveyor-error-reason metadata) for a bad
request (a structured-output constraint that does not compile included, found once
it has been compiled, before any token), INTERNAL when the model failed it,
ALREADY_EXISTS for a request id in flight, RESOURCE_EXHAUSTED (reason queue_full)
when the waiting queue is full, UNAVAILABLE while shutting down. A cancelled stream
aborts the request. A request with n > 1 streams its samples' chunks interleaved,
each naming its sample (index). A request naming a LoRA adapter the engine does not
hold waits while a worker thread reads it (LoadLoraAdapter does the same on its own);
an adapter that cannot be read is INVALID_ARGUMENT, as is any adapter on an engine
with LoRA off.
Each finished sample leaves queue / prefill / decode spans under the call's span
(request_tracing).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from conveyor.common.errors import ERROR_REASON_KEY, INVALID_REQUEST, QUEUE_FULL
from conveyor.common.sampling_fields import KNOBS
from conveyor.engine.async_engine import AsyncEngine, EngineStoppedError, RequestFailedError
from conveyor.engine.core.errors import DuplicateRequestId, WaitingQueueFull
from conveyor.engine.core.request import FinishReason
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.lora.adapter import InvalidAdapter, LoraAdapter
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_tracing import RequestSpans
from conveyor.engine.request_validation import InvalidRequestError, validate_request
from conveyor.engine.sampling_params import InvalidSamplingParams, SamplingParams
from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams
from conveyor.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("conveyor.engine.servicer")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name

_FINISH_REASONS = {
    None: engine_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
    FinishReason.QUEUE_FULL: engine_pb2.FINISH_REASON_ABORT,  # raised as WaitingQueueFull
}


_LORA_OFF = "this engine serves no LoRA adapters (CONVEYOR_ENGINE_ENABLE_LORA is off)"


def _adapter_info(adapter: LoraAdapter) -> engine_pb2.LoraAdapterInfo:
    return engine_pb2.LoraAdapterInfo(name=adapter.name, rank=adapter.rank,
                                      target_modules=adapter.target_modules)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def Generate(self, request, context):
        try:
            engine_request = self.to_engine_request(request)
            if request.HasField("lora"):
                engine_request.lora = await self._adapter(request.lora)
        except (InvalidRequestError, InvalidSamplingParams, InvalidAdapter) as exc:
            reason = getattr(exc, "reason", INVALID_REQUEST)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                                trailing_metadata=((ERROR_REASON_KEY, reason),))
        spans = RequestSpans(engine_request, self.engine.info)
        try:
            async for delta in self.engine.generate(engine_request):
                spans.observe(delta)
                yield to_response(delta)
        except InvalidRequestError as exc:  # a constraint that does not compile
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                                trailing_metadata=((ERROR_REASON_KEY, exc.reason),))
        except RequestFailedError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except DuplicateRequestId as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except WaitingQueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                                trailing_metadata=((ERROR_REASON_KEY, QUEUE_FULL),))
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def LoadLoraAdapter(self, request, context):
        if self.engine.loras is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _LORA_OFF)
        try:
            adapter = await self._adapter(request)
        except InvalidAdapter as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return _adapter_info(adapter)

    async def UnloadLoraAdapter(self, request, context):
        loras = self.engine.loras
        adapter = loras.unload(request.name) if loras is not None else None
        if adapter is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"this engine holds no adapter {request.name!r}")
        return _adapter_info(adapter)

    async def _adapter(self, proto: engine_pb2.LoraAdapter) -> LoraAdapter:
        """The adapter named, read on a worker thread unless held (InvalidAdapter)."""
        loras = self.engine.loras
        if loras is None:
            raise InvalidAdapter(_LORA_OFF)
        held = loras.find(proto.name, proto.path)
        if held is not None:
            return held
        return await asyncio.to_thread(loras.load, proto.name, proto.path)

    async def Info(self, request, context):
        info = self.engine.info
        return engine_pb2.EngineInfo(
            model=info.model, max_model_len=info.max_model_len, block_size=info.block_size,
            num_blocks=info.num_blocks, kv_capacity_tokens=info.kv_capacity_tokens,
            attention_backend=info.attention_backend, dtype=info.dtype, engine_id=info.engine_id,
            max_loras=info.max_loras, max_lora_rank=info.max_lora_rank,
        )

    async def Stats(self, request, context):
        return stats_message(self.engine.stats())

    def to_engine_request(self, request: engine_pb2.GenerateRequest) -> EngineRequest:
        """Convert and validate; raises InvalidRequestError or InvalidSamplingParams."""
        prompt = list(request.prompt_token_ids)
        engine_request = EngineRequest(
            request_id=request.request_id or f"engine-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling_params=to_sampling_params(
                request.sampling, self._room_after(prompt), num_samples=request.n or 1,
                structured_outputs=to_structured_outputs(request)),
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            output_token_ids=list(request.resume_output_token_ids),
        )
        validate_request(engine_request, self.engine.info)
        return engine_request

    def _room_after(self, prompt: list[int]) -> int:
        """max_tokens when unset (0): the rest of the context, at least 1."""
        return max(1, self.engine.info.max_model_len - len(prompt))


def stats_message(stats: EngineStats) -> engine_pb2.EngineStats:
    """Stats' answer; the registry heartbeat carries its load too (EngineLoad.from_stats)."""
    return engine_pb2.EngineStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage, num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks, prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_preemptions=stats.num_preemptions,
        num_waiting_tokens=stats.num_waiting_tokens,
        max_num_waiting_seqs=stats.max_num_waiting_seqs,
        max_num_waiting_tokens=stats.max_num_waiting_tokens,
        num_requests_shed=stats.num_requests_shed,
        lora_adapters=stats.lora_adapters,
    )


def to_sampling_params(proto: engine_pb2.SamplingParams, default_max_tokens: int,
                       num_samples: int = 1,
                       structured_outputs: StructuredOutputsParams | None = None
                       ) -> SamplingParams:
    """Unset optional fields (the knobs of the shared table) keep SamplingParams'
    defaults; max_tokens 0 means the rest of the context."""
    values = {knob.name: getattr(proto, knob.name) for knob in KNOBS
              if proto.HasField(knob.name)}
    if values.get("top_k") == -1:
        values["top_k"] = 0
    return SamplingParams(
        **values,
        n=num_samples,
        structured_outputs=structured_outputs,
        logit_bias=dict(proto.logit_bias),
        max_tokens=proto.max_tokens or default_max_tokens,
        min_tokens=proto.min_tokens,
        stop_token_ids=list(proto.stop_token_ids),
        allowed_token_ids=list(proto.allowed_token_ids),
        bad_words=[list(sequence.ids) for sequence in proto.bad_words],
        ignore_eos=proto.ignore_eos,
        logprobs=proto.logprobs or proto.top_logprobs > 0,
        top_logprobs=proto.top_logprobs,
        prompt_logprobs=(proto.prompt_logprobs if proto.HasField("prompt_logprobs")
                         else None),
    )


def to_structured_outputs(request: engine_pb2.GenerateRequest) -> StructuredOutputsParams | None:
    """GenerateRequest.structured_output as the engine's constraint (None when unset);
    InvalidSamplingParams for an empty choice or json_object false."""
    if not request.HasField("structured_output"):
        return None
    proto = request.structured_output
    kind = proto.WhichOneof("kind")
    if kind is None:
        raise InvalidSamplingParams("structured_output has no kind set")
    if kind == "json_schema":
        return StructuredOutputsParams(json=proto.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(proto.choice.options))
    return StructuredOutputsParams(**{kind: getattr(proto, kind)})


def to_response(delta: RequestDelta) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(
        index=delta.index,
        token_ids=delta.new_token_ids,
        finish_reason=_FINISH_REASONS[delta.finish_reason],
        usage=engine_pb2.Usage(prompt_tokens=delta.num_prompt_tokens,
                               completion_tokens=delta.num_output_tokens,
                               cached_tokens=delta.num_cached_tokens,
                               draft_tokens=delta.num_draft_tokens,
                               accepted_draft_tokens=delta.num_accepted_draft_tokens),
    )
    for sampled in delta.new_logprobs or ():
        position = response.logprobs.add(logprob=sampled.logprob or 0.0)
        for token_id, logprob in sampled.top_logprobs or ():
            position.top.add(token_id=token_id, logprob=logprob)
    for entry in delta.prompt_logprobs or ():
        position = response.prompt_logprobs.add(logprob=entry.logprob, rank=entry.rank)
        for token_id, logprob in entry.top:
            position.top.add(token_id=token_id, logprob=logprob)
    if delta.stop_token_id is not None:
        response.stop_token_id = delta.stop_token_id
    return response
