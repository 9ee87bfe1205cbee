"""In-process fake tokenizer, engine and detok servicers (unit tests only).

The fake model's token ids are character codes: the tokenizer maps each
character of the rendered prompt to ord(c), the engine "generates" the
characters of a fixed script, and detok turns ids back into characters.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, ERROR_REASON_KEY, ERROR_SERVICE_KEY
from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.v1 import (
    detok_pb2,
    detok_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

MODEL = "fake-model"
MAX_MODEL_LEN = 128
VOCAB_SIZE = 1000
SCRIPT = "Hello there, friend. This is a fake model talking slowly."


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Records each Decode request in `decodes`."""

    def __init__(self) -> None:
        self.decodes: list = []

    async def Render(self, request, context):
        text = "".join(f"{m.role}:{m.content}{''.join(p.text for p in m.parts)}\n"
                       for m in request.messages) + "assistant:"
        return await self._reply(text, request, context)

    async def Tokenize(self, request, context):
        if request.HasField("token_ids"):
            if any(i >= VOCAB_SIZE for i in request.token_ids.ids):  # as the real one refuses
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token id out of range")
            text = "".join(chr(i) for i in request.token_ids.ids)
        else:
            text = request.text
        return await self._reply(text, request, context)

    async def _reply(self, text, request, context):
        """As the real one: checked against the request's max_model_len (the engines'),
        else the model's own."""
        ids = [ord(c) % VOCAB_SIZE for c in text]
        max_tokens, max_model_len = request.max_tokens, request.max_model_len or MAX_MODEL_LEN
        if len(ids) + max_tokens > max_model_len:
            context.set_trailing_metadata(((ERROR_REASON_KEY, CONTEXT_LENGTH_EXCEEDED),))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion).",
            )
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt_text=text,
                                              num_tokens=len(ids), max_model_len=max_model_len)

    async def Decode(self, request, context):
        self.decodes.append(request)
        if any(i >= VOCAB_SIZE for i in request.token_ids):  # as the real tokenizer refuses
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token id outside the vocabulary")
        if request.token_strings:
            return tokenizer_pb2.DecodeResponse(token_strings=[f"<{i}>" for i in request.token_ids])
        return tokenizer_pb2.DecodeResponse(text="".join(chr(i) for i in request.token_ids))

    async def Info(self, request, context):
        return tokenizer_pb2.TokenizerInfo(model=MODEL, vocab_size=VOCAB_SIZE,
                                           max_model_len=MAX_MODEL_LEN)


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServicer):
    """Streams SCRIPT one character per chunk, `delay_s` apart, each token reported as
    coming with 2 verified drafts, 1 accepted. `fail_after` tokens (None: never) it aborts
    with `fail_code`. Tracks running and cancelled requests.

    LoRA: serves `max_loras` adapters (0: none, FAILED_PRECONDITION on a load); holds
    `lora_adapters` (a Generate naming another adds it, as the engine reads it from its
    path), refuses paths in `unreadable_lora_paths` with INVALID_ARGUMENT."""

    delay_s: float = 0.0
    fail_after: int | None = None
    fail_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    fail_once: bool = False
    """Fail only the first request that reaches `fail_after` (an engine that died)."""
    fail_reason: str | None = None
    """The failure's reason (trailing metadata), e.g. queue_full: an engine shedding."""
    running: set[str] = field(default_factory=set)
    cancelled: list[str] = field(default_factory=list)
    requests: list = field(default_factory=list)
    max_loras: int = 4
    max_model_len: int = MAX_MODEL_LEN
    block_size: int = 16
    lora_adapters: list[str] = field(default_factory=list)
    unreadable_lora_paths: set[str] = field(default_factory=set)
    lora_calls: list[tuple[str, str]] = field(default_factory=list)
    """("load" or "unload", adapter name) per LoRA call, in order."""

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.HasField("lora") and request.lora.name not in self.lora_adapters:
            self.lora_adapters.append(request.lora.name)
        self.running.add(request.request_id)
        finished = False
        try:
            async for chunk in self._chunks(request, context):
                yield chunk
            finished = True
        finally:
            self.running.discard(request.request_id)
            if not finished:
                self.cancelled.append(request.request_id)

    async def _chunks(self, request, context):
        """Position by position, one chunk per sample (n of them, by index)."""
        sampling = request.sampling
        num_prompt = len(request.prompt_token_ids)
        for i in range(len(request.resume_output_token_ids), sampling.max_tokens):
            if self.fail_after is not None and i >= self.fail_after:
                if self.fail_once:
                    self.fail_after = None
                if self.fail_reason is not None:
                    context.set_trailing_metadata(((ERROR_REASON_KEY, self.fail_reason),))
                await context.abort(self.fail_code, "fake engine failure")
            await asyncio.sleep(self.delay_s)
            token = ord(SCRIPT[i % len(SCRIPT)])
            last = i == sampling.max_tokens - 1
            num_produced = i + 1 - len(request.resume_output_token_ids)  # by this engine
            for index in range(max(1, request.n)):
                first = i == len(request.resume_output_token_ids) and index == 0
                yield engine_pb2.GenerateResponse(
                    index=index,
                    token_ids=[token],
                    logprobs=[_logprobs(token, sampling)] if sampling.logprobs else [],
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else 0,
                    usage=engine_pb2.Usage(prompt_tokens=num_prompt, completion_tokens=i + 1,
                                           cached_tokens=3, draft_tokens=2 * num_produced,
                                           accepted_draft_tokens=num_produced),
                    prompt_logprobs=_prompt_logprobs(request) if first else [],
                )

    async def Stats(self, request, context):
        return engine_pb2.EngineStats(num_running=len(self.running), num_blocks=10,
                                      num_free_blocks=10, lora_adapters=self.lora_adapters)

    async def Info(self, request, context):
        return engine_pb2.EngineInfo(model=MODEL, max_model_len=self.max_model_len,
                                     block_size=self.block_size, max_loras=self.max_loras,
                                     max_lora_rank=16)

    async def LoadLoraAdapter(self, request, context):
        self.lora_calls.append(("load", request.name))
        if not self.max_loras:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off")
        if request.path in self.unreadable_lora_paths:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"no adapter_config.json in {request.path}")
        if request.name not in self.lora_adapters:
            self.lora_adapters.append(request.name)
        return engine_pb2.LoraAdapterInfo(name=request.name, rank=8,
                                          target_modules=["q_proj", "v_proj"])

    async def UnloadLoraAdapter(self, request, context):
        self.lora_calls.append(("unload", request.name))
        if request.name not in self.lora_adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.name}")
        self.lora_adapters.remove(request.name)
        return engine_pb2.LoraAdapterInfo(name=request.name)


def _logprobs(token: int, sampling) -> engine_pb2.PositionLogprobs:
    top = [engine_pb2.TokenLogprob(token_id=token + k, logprob=-0.5 - k)
           for k in range(sampling.top_logprobs)]
    return engine_pb2.PositionLogprobs(logprob=-0.5, top=top)


def _prompt_logprobs(request) -> list[engine_pb2.PositionLogprobs]:
    """When asked for: position p's prompt token at logprob -p/10 and rank p, and
    prompt_logprobs alternatives (the token's id + 1, + 2, ...)."""
    if not request.sampling.HasField("prompt_logprobs"):
        return []
    prompt = request.prompt_token_ids
    return [engine_pb2.PositionLogprobs(
        logprob=-p / 10, rank=p,
        top=[engine_pb2.TokenLogprob(token_id=prompt[p] + k + 1, logprob=-k - 0.5)
             for k in range(request.sampling.prompt_logprobs)])
        for p in range(1, len(prompt))]


class FakeDetok(detok_pb2_grpc.DetokenizerServicer):
    """Opens the engine's stream and turns ids back into characters; stop strings matched
    on each sample's whole text, its last len(longest stop) - 1 characters held back
    until they cannot start a match (or the sample finishes); a resumed stream holds back
    the text the caller has; logprobs come with the texts of the ids they show (chr(id)).
    The engine's failure is passed on, named as the engine's."""

    def __init__(self) -> None:
        self.streams_closed = 0
        self.requests: list = []

    async def Generate(self, request, context):
        self.requests.append(request)
        channel = open_channel(request.engine_address)
        call = engine_pb2_grpc.EngineStub(channel).Generate(request.generate)
        try:
            async for response in _text_responses(request, call):
                yield response
        except grpc.aio.AioRpcError as error:
            reasons = [(k, v) for k, v in error.trailing_metadata() or ()
                       if k == ERROR_REASON_KEY]
            context.set_trailing_metadata((*reasons, (ERROR_SERVICE_KEY, "engine")))
            await context.abort(error.code(), error.details())
        finally:
            call.cancel()
            self.streams_closed += 1
            await channel.close()


_ENDS = (engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH)


async def _text_responses(request, call):
    n, stops = max(1, request.generate.n), list(request.detok.stop)
    hold = max((len(stop) - 1 for stop in stops), default=0)
    texts = ["".join(chr(i) for i in request.generate.resume_output_token_ids)] + [""] * (n - 1)
    sent, done = [request.text_so_far.num_chars] + [0] * (n - 1), [False] * n
    async for chunk in call:
        i = chunk.index
        if done[i]:
            continue
        before = len(texts[i])
        texts[i] += "".join(chr(t) for t in chunk.token_ids)
        response = detok_pb2.TextGenerateResponse(
            index=i, token_ids=chunk.token_ids, logprobs=chunk.logprobs,
            prompt_logprobs=chunk.prompt_logprobs, usage=chunk.usage)
        match = min(((texts[i].find(s), s) for s in stops if s in texts[i]), default=None)
        if match is not None:
            at, stop = match
            end = at + len(stop) if request.detok.include_stop_str_in_output else at
            kept = at + len(stop) - before
            del response.token_ids[kept:], response.logprobs[kept:]
            response.text_delta, sent[i], done[i] = texts[i][sent[i]:end], end, True
            response.finish_reason, response.stop_string = engine_pb2.FINISH_REASON_STOP, stop
            response.usage.completion_tokens = at + len(stop)
        else:
            done[i] = chunk.finish_reason in _ENDS
            ready = max(sent[i], len(texts[i]) - (0 if done[i] else hold))
            response.text_delta, sent[i] = texts[i][sent[i]:ready], ready
            response.finish_reason = chunk.finish_reason
            if chunk.HasField("stop_token_id"):
                response.stop_token_id = chunk.stop_token_id
        response.token_texts.update(_shown_texts(response, request.generate.prompt_token_ids))
        yield response
        if all(done):
            return


def _shown_texts(response, prompt_ids) -> dict[int, str]:
    """As the real detok: the text of each id the response's logprobs show."""
    ids = [*response.token_ids[:len(response.logprobs)],
           *(prompt_ids if response.prompt_logprobs else ()),
           *(t.token_id for p in (*response.logprobs, *response.prompt_logprobs) for t in p.top)]
    return {i: chr(i) for i in ids}


@dataclass
class FakeServices:
    tokenizer: FakeTokenizer
    engine: FakeEngine
    detok: FakeDetok
    servers: list
    script: str = SCRIPT
    model: str = MODEL
    max_model_len: int = MAX_MODEL_LEN
    vocab_size: int = VOCAB_SIZE

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.servers[['tokenizer', 'engine', 'detok'].index(name)].port}"

    async def stop(self) -> None:
        for server in self.servers:
            await server.server.stop(grace=None)


async def start_fakes() -> FakeServices:
    tokenizer, engine, detok = FakeTokenizer(), FakeEngine(), FakeDetok()
    registrations = [
        ServiceRegistration("conveyor.v1.Tokenizer",
                            tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer),
        ServiceRegistration("conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server,
                            engine),
        ServiceRegistration("conveyor.v1.Detokenizer",
                            detok_pb2_grpc.add_DetokenizerServicer_to_server, detok),
    ]
    servers = [await start_grpc_server(ServiceSettings(port=0), [r]) for r in registrations]
    return FakeServices(tokenizer, engine, detok, servers)
