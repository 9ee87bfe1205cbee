"""One request handed to the engine, already validated and converted from its wire form."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conveyor.engine.lora.adapter import LoraAdapter
from conveyor.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """What a caller (the gRPC servicer or the offline LLM) asks the engine to run.

    `sampling_params.n > 1` fans out into n requests `f"{request_id}-{i}"` that
    share the prompt's cached blocks; their deltas carry `index = i`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Lower runs first; ties go to the earlier arrival."""
    cache_salt: str | None = None
    """Mixed into prefix-cache hashes; requests with different salts share no blocks."""
    lora: LoraAdapter | None = None
    """The LoRA adapter to run with, already read (AdapterStore.load); None: the base model.
    Its prefix-cache blocks are its own, as a salt's are."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    """Output already produced elsewhere (a moved stream): continued after, never sent."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
