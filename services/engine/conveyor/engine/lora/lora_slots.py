"""Which adapter sits in which slot of the model's LoRA projections.

`attach_lora` wraps every adapted projection of the model in a LoraLinear with
`max_loras` slots. Before each step the runner tells `LoraSlots.set_step` its requests,
which gives each row the slot of its request's adapter: an adapter the step needs that no
slot holds is copied into the lowest free slot, or over the least recently used adapter
the step does not need (a copy of a few MB; reading the files happened off the step loop,
adapter_store.py). The scheduler never puts more than `max_loras` adapters in one step, so
there is always room.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.lora.adapter import FUSED_PROJECTIONS, LoraAdapter, projection_shapes
from conveyor.engine.lora.lora_linear import LoraBatch, LoraLinear
from conveyor.engine.model.llama import LlamaForCausalLM


class LoraSlots:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.batch = LoraBatch(max_loras, max_rank, device)
        self.projections = attach_lora(model, self.batch, dtype, device)
        self._held: OrderedDict[str, int] = OrderedDict()
        """Adapter key -> its slot, least recently used first."""

    def set_step(self, requests: list[ScheduledRequest]) -> None:
        """Tell the LoRA projections each row's slot (-1: the base model), loading the
        step's adapters into slots first."""
        slots = np.fromiter((self._slot_of(r.lora, requests) for r in requests), np.int64,
                            len(requests))
        if not len(slots) or slots.max() < 0:
            self.batch.set_step(None)
            return
        query_lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, len(requests))
        self.batch.set_step(np.repeat(slots, query_lens))

    def _slot_of(self, adapter: LoraAdapter | None, requests: list[ScheduledRequest]) -> int:
        if adapter is None:
            return -1
        slot = self._held.get(adapter.key)
        if slot is None:
            slot = self._load(adapter, {r.lora.key for r in requests if r.lora is not None})
        self._held.move_to_end(adapter.key)
        return slot

    def _load(self, adapter: LoraAdapter, needed: set[str]) -> int:
        free = sorted(set(range(self.batch.max_loras)) - set(self._held.values()))
        if free:
            slot = free[0]
        else:
            victim = next((key for key in self._held if key not in needed), None)
            if victim is None:
                raise ValueError(f"a step needs more than max_loras={self.batch.max_loras} "
                                 "adapters")
            slot = self._held.pop(victim)
        for (layer, projection), module in self.projections.items():
            module.set_slot(slot, adapter.weights.get((layer, projection)))
        self.batch.ranks[slot] = adapter.rank
        self._held[adapter.key] = slot
        return slot


def attach_lora(model: LlamaForCausalLM, batch: LoraBatch, dtype: torch.dtype,
                device: torch.device) -> dict[tuple[int, str], LoraLinear]:
    """Wrap each projection LoRA may adapt in a LoraLinear; (layer, projection) -> it."""
    shapes = projection_shapes(model.config)
    wrapped = {}
    for index, layer in enumerate(model.model.layers):
        for projection, (block_name, _) in FUSED_PROJECTIONS.items():
            block = getattr(layer, block_name)
            in_features, outs = shapes[projection]
            module = LoraLinear(getattr(block, projection), outs, in_features, batch, dtype,
                                device)
            setattr(block, projection, module)
            wrapped[(index, projection)] = module
    return wrapped
