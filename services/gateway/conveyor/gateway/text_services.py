"""Clients of the text services, balanced over their replicas, and the model they serve.

The tokenizer: unary calls (render, tokenize, decode, info); a call a replica fails to
answer is retried on another (ReplicaSet.call). `ModelCatalog` asks it once (Info) what
model is served; the served-name setting wins. A LoRA adapter of the adapter catalog
(lora/catalog.py) is a model too, for the tenants it is visible to: the base model run
with that adapter, under the adapter's name (as vLLM serves them).

Detok: one bidirectional stream per generation. A stream whose replica fails is rebuilt
on another replica: it re-sends its options and every token id so far (and the finish,
if sent), and skips as much of the new stream's text and tool-call pieces as the caller
already got: detokenization and tool-call reading are deterministic, so the new stream
starts with the old. The caller sees one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass, replace

from redis.exceptions import RedisError

from conveyor.common.replica_set import ReplicaSet
from conveyor.gateway import wire
from conveyor.gateway.errors import model_not_found
from conveyor.gateway.lora.catalog import AdapterRecord, LoraCatalog
from conveyor.gateway.wire import (
    DetokOptions,
    GenerateJob,
    LoraAdapter,
    PromptInput,
    PromptTokens,
    RenderInput,
    TextSoFar,
    TokenizerFacts,
    UpstreamError,
    translate_rpc_errors,
)
from conveyor.v1 import detok_pb2_grpc, tokenizer_pb2_grpc

# -- tokenizer client --------------------------------------------------------------------

TOKENIZER_SERVICE = "tokenizer"


class TokenizerClient:
    """Unary calls to the tokenizer replicas, each with a deadline."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    async def render(self, render: RenderInput) -> PromptTokens:
        return wire.prompt_tokens(await self._call("Render", wire.render_request(render)))

    async def tokenize(self, prompt: PromptInput) -> PromptTokens:
        return wire.prompt_tokens(
            await self._call("Tokenize", wire.tokenize_request(prompt)))

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return wire.decoded_text(await self._call(
            "Decode", wire.decode_request(token_ids, skip_special_tokens)))

    async def decode_each(self, token_ids: list[int]) -> list[str]:
        """The text of each id alone (special tokens kept), in one call."""
        texts = wire.decoded_token_texts(await self._call(
            "Decode", wire.decode_request(token_ids, False, each_token=True)))
        if len(texts) != len(token_ids):
            raise UpstreamError("tokenizer", "INTERNAL", f"Decode gave {len(texts)} texts for "
                                f"{len(token_ids)} token ids")
        return texts

    async def info(self) -> TokenizerFacts:
        return wire.tokenizer_facts(
            await self._call("Info", wire.tokenizer_info_request()))

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


# -- model catalog -----------------------------------------------------------------------

models_log = logging.getLogger("conveyor.gateway.models")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    backend_name: str = ""
    """The name the tokenizer and the engines serve it under (routing filters engines by
    it); `name` differs when the gateway's served_model_name renames it for clients."""
    lora: LoraAdapter | None = None
    """The LoRA adapter its requests run with (None: the base model itself)."""
    parent: str | None = None
    """An adapter's base model, by its name for clients."""

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    def with_adapter(self, record: AdapterRecord) -> ServedModel:
        """This base model run with the adapter of `record`, under the adapter's name."""
        return replace(self, name=record.name, lora=record.adapter, parent=self.name)


class ModelCatalog:
    """Asks the tokenizer once (Info) what it serves; the served-name setting wins. The
    adapters of `adapters` are served on it."""

    def __init__(self, tokenizer: TokenizerClient, served_model_name: str | None,
                 adapters: LoraCatalog):
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self.adapters = adapters
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    async def model(self) -> ServedModel:
        """The served model; the first call asks the tokenizer (UpstreamError if it can't)."""
        if self._model is None:
            async with self._lock:
                if self._model is None:
                    facts = await self._tokenizer.info()
                    self._model = ServedModel(self._served_model_name or facts.model,
                                              facts.max_model_len, facts.vocab_size,
                                              facts.model)
        return self._model

    async def resolve(self, requested: str | None, tenant_id: str | None) -> ServedModel:
        """The served model if `requested` names it (or is absent), the adapter it names if
        `tenant_id` may see that one (None: a caller without a key, who sees the public
        adapters); 404 model_not_found otherwise."""
        model = await self.model()
        if requested is None or requested == model.name:
            return model
        record = await self.adapters.get(requested)
        if record is None or not record.is_visible_to(tenant_id):
            raise model_not_found(requested)
        return model.with_adapter(record)

    async def models(self, tenant_id: str | None) -> list[ServedModel]:
        """The served model, then the adapters `tenant_id` may see (as in `resolve`); the
        served model alone while the adapters cannot be read (Redis unavailable)."""
        model = await self.model()
        try:
            records = await self.adapters.list()
        except RedisError as error:
            models_log.warning("LoRA catalog unavailable, listing the base model alone: %s",
                               error)
            return [model]
        return [model, *(model.with_adapter(r) for r in records
                         if r.is_visible_to(tenant_id) and r.name != model.name)]


# -- detok client ------------------------------------------------------------------------

DETOK_SERVICE = "detok"
log = logging.getLogger("conveyor.gateway.detok")


class TextStream:
    """One detok Generate call: iterate it for GenerationDeltas. A failed call is an
    UpstreamError naming the service that failed (the engine's failure, passed on by
    detok, names the engine). `cancel()` ends the call (and so the engine's stream)."""

    def __init__(self, call, replica: str):
        self._call = call
        self.replica = replica
        """The detok replica's address."""

    async def __aiter__(self):
        with translate_rpc_errors(DETOK_SERVICE):
            async for message in self._call:
                yield wire.generation_delta(message)

    def cancel(self) -> None:
        self._call.cancel()


class DetokClient:
    """Opens generations on the detok replicas (each opens the engine's stream)."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float = 2.0):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    @property
    def max_attempts(self) -> int:
        """Most replicas one generation is tried on."""
        return self._replicas.max_attempts

    async def generate(self, engine_address: str, job: GenerateJob, options: DetokOptions,
                       sample_ids: list[str], so_far: TextSoFar | None = None,
                       exclude: Collection[str] = ()) -> TextStream:
        """`job` on the engine at `engine_address`, as text, through a replica not in
        `exclude` (UpstreamError UNAVAILABLE when none is left)."""
        with translate_rpc_errors(DETOK_SERVICE):
            replica = await self._replicas.pick(exclude=exclude)
        request = wire.text_generate_request(engine_address, job, options, sample_ids, so_far)
        return TextStream(detok_pb2_grpc.DetokenizerStub(replica.channel).Generate(request),
                          replica.address)

    def failed(self, replica: str, error: UpstreamError) -> None:
        """A replica's call broke: pick around it for a while."""
        log.warning("detok replica %s failed (%s: %s)", replica, error.code, error.message)
        self._replicas.mark_unreachable(replica)

    async def is_serving(self) -> bool:
        return await self._replicas.is_serving(self._timeout_s)

    async def close(self) -> None:
        await self._replicas.close()
