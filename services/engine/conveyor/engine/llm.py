"""The offline (in-process) API, as vLLM's `LLM`: batch generation without a server.

    from conveyor.engine import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    print(outputs[0].outputs[0].text)
    answer = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

All requests of one call run together under continuous batching on the caller's
thread; the call returns when every request finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from conveyor.common.models import load_tokenizer, resolve_model
from conveyor.common.settings import DEFAULT_MODEL
from conveyor.engine.completion_output import CompletionOutput
from conveyor.engine.engine_factory import build_engine_core
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.lora.adapter import LoraAdapter
from conveyor.engine.lora.lora_request import LoRARequest
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_output import RequestOutput
from conveyor.engine.request_validation import validate_request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.settings import EngineSettings
from conveyor.engine.structured.errors import InvalidConstraint

PROGRESS_BAR_MIN_REQUESTS = 8
"""With use_tqdm=None, batches at least this long show a progress bar."""

UNBOUNDED_WAITING = {"max_num_waiting_seqs": 0, "max_num_waiting_tokens": 0}
"""Offline, `generate` queues every prompt at once: no waiting bound unless one is given."""

PromptInput = str | list[int] | dict[str, Any]
"""A text prompt, its token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}."""


class LLM:
    """A model with its own engine. Keyword arguments are EngineSettings fields
    (block_size, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_gib,
    num_kv_blocks, dtype, device, attention_backend, enable_prefix_caching, seed, ...)."""

    def __init__(self, model: str = DEFAULT_MODEL, **settings: Any):
        self.settings = EngineSettings(model=model, **{**UNBOUNDED_WAITING, **settings})
        self.core = build_engine_core(self.settings)
        self.tokenizer = load_tokenizer(resolve_model(model))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in the prompts' order.

        `priority` (one per prompt, lower runs first) orders admission and picks
        preemption victims, as in the server. `lora_request` (one for all, or one per
        prompt, None for the base model) runs prompts with LoRA adapters (enable_lora).

        Raises ValueError (before running anything) when a prompt is empty, too long
        for max_model_len with its max_tokens, or has token ids outside the vocabulary;
        InvalidConstraint (a ValueError) when a structured_outputs constraint does not
        compile, with the grammar library's message.
        """
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items))
        outputs = [self._output(item) for item in items]
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise ValueError(f"got {len(priorities)} priorities for {len(items)} prompts")
        adapters = self._adapters(lora_request, len(items))
        requests = [self._request(o, p, rank, adapter) for o, p, rank, adapter
                    in zip(outputs, params, priorities, adapters, strict=True)]
        for request in requests:
            validate_request(request, self.core.info)
        self._run(requests, outputs, _show_progress(use_tqdm, len(requests)))
        return outputs

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation (a list of {"role", "content"}) with the model's chat
        template, then generate as `generate` does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": self._render(c, add_generation_prompt, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _render(self, conversation, add_generation_prompt: bool, kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt,
            **(kwargs or {}))

    def _output(self, item: PromptInput) -> RequestOutput:
        text, token_ids = _prompt_parts(item)
        if token_ids is None:
            token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return RequestOutput(str(next(self._ids)), text, list(token_ids))

    def _adapters(self, lora_request, num_prompts: int) -> list[LoraAdapter | None]:
        """Each prompt's adapter, read now; ValueError when LoRA is off or one is invalid."""
        if lora_request is None:
            return [None] * num_prompts
        wanted = ([lora_request] * num_prompts if isinstance(lora_request, LoRARequest)
                  else list(lora_request))
        if len(wanted) != num_prompts:
            raise ValueError(f"got {len(wanted)} lora_requests for {num_prompts} prompts")
        if self.core.loras is None and any(wanted):
            raise ValueError("LoRA adapters need enable_lora=True")
        return [None if w is None else self.core.loras.load(w.lora_name, w.lora_path)
                for w in wanted]

    @staticmethod
    def _request(output: RequestOutput, params: SamplingParams, priority: int,
                 lora: LoraAdapter | None = None) -> EngineRequest:
        output.outputs = [CompletionOutput(index=i) for i in range(params.n)]
        return EngineRequest(output.request_id, output.prompt_token_ids, params, priority,
                             lora=lora)

    def _run(self, requests: list[EngineRequest], outputs: list[RequestOutput],
             progress: bool) -> None:
        by_id = {o.request_id: o for o in outputs}
        try:
            for request in requests:
                self.core.add_request(request)
            with tqdm(total=len(requests), desc="Generating", unit="req",
                      disable=not progress) as bar:
                while self.core.has_unfinished_requests:
                    for delta in self.core.step():
                        output = by_id[delta.request_id]
                        self._apply(output, delta)
                        bar.update(int(delta.finished and output.finished))
        finally:  # an error (or Ctrl-C) leaves no request holding blocks
            self.core.abort(self.core.unfinished_request_ids)

    def _apply(self, output: RequestOutput, delta: RequestDelta) -> None:
        completion = output.outputs[delta.index]
        completion.token_ids.extend(delta.new_token_ids)
        _append_logprobs(completion, delta)
        output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
        if delta.invalid_request:
            raise InvalidConstraint(f"request {output.request_id}: {delta.error}")
        if delta.error is not None:
            raise RuntimeError(f"request {output.request_id} failed: {delta.error}")
        if delta.finished:
            completion.finish_reason = delta.finish_reason.value
            completion.stop_reason = delta.stop_token_id
            completion.text = self.tokenizer.decode(completion.token_ids,
                                                    skip_special_tokens=True)


def _append_logprobs(completion: CompletionOutput, delta: RequestDelta) -> None:
    if delta.new_logprobs is None:
        return
    if completion.logprobs is None:
        completion.logprobs, completion.cumulative_logprob = [], 0.0
    for token_id, sampled in zip(delta.new_token_ids, delta.new_logprobs, strict=False):
        position = dict(sampled.top_logprobs or ())
        position[token_id] = sampled.logprob
        completion.logprobs.append(position)
        completion.cumulative_logprob += sampled.logprob or 0.0


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return params


def _prompt_parts(item: PromptInput) -> tuple[str | None, list[int] | None]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, dict):
        if "prompt_token_ids" in item:
            return item.get("prompt"), list(item["prompt_token_ids"])
        return item["prompt"], None
    return None, list(item)


def _show_progress(use_tqdm: bool | None, num_requests: int) -> bool:
    if use_tqdm is None:
        return num_requests >= PROGRESS_BAR_MIN_REQUESTS
    return use_tqdm
