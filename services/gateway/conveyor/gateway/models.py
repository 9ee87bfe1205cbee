"""The models served: `ModelCatalog` asks the tokenizer once (Info) what model is served
(the served-name setting wins), and the live engines serving it how long a sequence they
take (the max_model_len each publishes: CONVEYOR_ENGINE_MAX_MODEL_LEN is its one setting).
A LoRA adapter of the adapter catalog (lora/catalog.py) is a
model too, for the tenants it is visible to: the base model run with that adapter, under
the adapter's name (as vLLM serves them)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from conveyor.gateway.clients.engine import LoraAdapter
from conveyor.gateway.clients.tokenizer import TokenizerClient
from conveyor.gateway.errors import model_not_found
from conveyor.gateway.lora.catalog import AdapterRecord, LoraCatalog

if TYPE_CHECKING:
    from conveyor.gateway.routing.router import LiveEngines

models_log = logging.getLogger("conveyor.gateway.models")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    max_model_len: int
    """What prompt + max_tokens must fit: the engines' (ModelCatalog.model)."""
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
    """Asks the tokenizer once (Info) what it serves; the served-name setting wins. Its
    max_model_len is the one `engines` publish (see `model`). The adapters of `adapters`
    are served on it."""

    def __init__(self, tokenizer: TokenizerClient, served_model_name: str | None,
                 adapters: LoraCatalog, engines: LiveEngines | None = None):
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self.adapters = adapters
        self._engines = engines
        self._model: ServedModel | None = None
        self._engines_max_model_len: int | None = None
        self._lock = asyncio.Lock()

    async def model(self) -> ServedModel:
        """The served model; the first call asks the tokenizer (UpstreamError if it can't).
        Its max_model_len is the smallest the live engines serving it publish, so a prompt
        fits whichever engine takes it (their listing is the router's, read again once a
        heartbeat interval); while none is live, the last one seen; before any was seen
        (or without `engines`), the model's own."""
        if self._model is None:
            async with self._lock:
                if self._model is None:
                    facts = await self._tokenizer.info()
                    self._model = ServedModel(self._served_model_name or facts.model,
                                              facts.max_model_len, facts.vocab_size,
                                              facts.model)
        max_model_len = await self._max_model_len_of_engines(self._model.backend_name)
        if max_model_len is None or max_model_len == self._model.max_model_len:
            return self._model
        return replace(self._model, max_model_len=max_model_len)

    async def _max_model_len_of_engines(self, backend_name: str) -> int | None:
        if self._engines is not None:
            published = [e.max_model_len for e in await self._engines.list_live(backend_name)
                         if e.max_model_len]
            if published:
                self._engines_max_model_len = min(published)
        return self._engines_max_model_len

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
