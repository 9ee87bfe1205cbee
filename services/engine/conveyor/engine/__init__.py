"""Conveyor's engine: paged KV cache, continuous batching and a Llama-family model.

`from conveyor.engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams` is
the offline (in-process) API.
"""

from conveyor.engine.lora.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it only when asked for.
    if name == "LLM":
        from conveyor.engine.llm import LLM

        return LLM
    raise AttributeError(name)
