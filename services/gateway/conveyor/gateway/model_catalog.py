"""The model this gateway serves: its name, context length and vocabulary size."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from conveyor.gateway.errors import model_not_found
from conveyor.gateway.tokenizer_client import TokenizerClient


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    backend_name: str = ""
    """The name the tokenizer and the engines serve it under (routing filters engines by
    it); `name` differs when the gateway's served_model_name renames it for clients."""


class ModelCatalog:
    """Asks the tokenizer once (Info) what it serves; the served-name setting wins."""

    def __init__(self, tokenizer: TokenizerClient, served_model_name: str | None):
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
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

    async def resolve(self, requested: str | None) -> ServedModel:
        """The served model if `requested` names it (or is absent); 404 otherwise."""
        model = await self.model()
        if requested is not None and requested != model.name:
            raise model_not_found(requested)
        return model
