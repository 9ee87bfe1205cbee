"""The model runner: executes one scheduled step on the model and the KV pool."""

from __future__ import annotations

import logging

import torch

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.engine.lora.lora_slots import LoraSlots
from conveyor.engine.model.llama import LlamaForCausalLM
from conveyor.engine.model.loader import load_model
from conveyor.engine.sampling.sampler import Sampler
from conveyor.engine.worker import kv_sizing
from conveyor.engine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from conveyor.engine.worker.draft_proposer import DraftModelProposer
from conveyor.engine.worker.kv_cache import allocate_kv_caches, kv_bytes_per_block
from conveyor.engine.worker.profile_step import profiling_step
from conveyor.engine.worker.prompt_logprobs import prompt_logprobs
from conveyor.engine.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV pool and the sampler; `execute` runs one step.

    Invariants: the pool has `capacity.num_blocks` blocks of `config.block_size`
    tokens, and block ids in a SchedulerOutput must be below that. `execute` waits
    for the device at most once: reading the sampled tokens, or (a step where no
    request samples) waiting for the step's input copies only, so the next step may
    refill the pinned host buffers; the step's kernels may still be running then.
    With `decode_graphs` (GPU, triton, cuda_graphs on), decode steps within the
    captured sizes replay CUDA graphs over the same input buffers (cuda_graphs.py).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] | None = None,
                 model: LlamaForCausalLM | None = None) -> None:
        self.config = config  # frozen and checked when it was made
        self.device = torch.device(config.device)
        self.model = model or load_model(config.model, dtype=config.torch_dtype,
                                         device=self.device,
                                         attention_backend=config.backend_name,
                                         weight_format=config.weight_format)
        self.model_config = self.model.config
        self.max_model_len = self._resolve_max_model_len()
        self.backend = self.model.model.layers[0].self_attn.backend
        self.sampler = Sampler(eos_token_ids if eos_token_ids is not None
                               else self.model_config.eos_token_ids,
                               self.model_config.vocab_size, self.device, config.seed)
        self.inputs = StepInputBuilder(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            block_size=config.block_size, device=self.device)
        self.decode_graphs: DecodeGraphs | None = None
        self.loras = (LoraSlots(self.model, config.max_loras, config.max_lora_rank,
                                config.torch_dtype, self.device) if config.max_loras else None)
        """The model's LoRA projections and which adapter is in which slot; None: no LoRA."""
        self.drafter: DraftModelProposer | None = None
        """Proposes drafts in the slots the scheduler leaves for them (speculative_method
        "draft"); None otherwise, and while the pool is sized (the profiling step runs
        the model alone)."""
        draft_model = self._load_draft_model() if config.draft_model else None
        self.capacity = self._size_kv_pool(draft_model)
        self.kv_caches = allocate_kv_caches(self.model_config, self.capacity.num_blocks,
                                            config.block_size, config.torch_kv_dtype,
                                            self.device)
        if config.uses_cuda_graphs:
            self.decode_graphs = self.build_decode_graphs()
        if draft_model is not None:
            self.drafter = self._draft_proposer(draft_model)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: write the new K/V, sample where a request needs a token, and
        take the prompt logprobs of the requests that asked for them."""
        if output.is_empty:
            return ModelRunnerOutput()
        inputs, hidden = self._hidden(output)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        prompt = prompt_logprobs(output, hidden, self.model.compute_logits)
        if not inputs.sample_requests:
            self.inputs.fence.wait()
            return ModelRunnerOutput(prompt_logprobs=prompt)
        sampled = self.sampler.sample(logits, inputs.sample_requests)
        self.inputs.fence.mark_complete()  # reading the tokens waited for the stream
        return ModelRunnerOutput({r.request_id: tokens for r, tokens
                                  in zip(inputs.sample_requests, sampled, strict=True)}, prompt)

    @torch.inference_mode()
    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """Run one step like `execute` but return the fp32 logits [R, V] of the rows
        it would sample (in scheduled order) instead of sampling."""
        return self._logits(output)[1].float()

    def _logits(self, output: SchedulerOutput) -> tuple[StepInputs, torch.Tensor]:
        """The step's inputs and the logits [N, V] of its sampling rows."""
        inputs, hidden = self._hidden(output)
        return inputs, self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))

    def _hidden(self, output: SchedulerOutput) -> tuple[StepInputs, torch.Tensor]:
        """The step's inputs and its final hidden states [T, hidden]: replayed from a
        CUDA graph for a decode step within a captured size, else run eagerly. The draft
        model first fills the draft slots the scheduler left, if any."""
        if self.drafter is not None:
            self.drafter.fill(output)
        size = self.decode_graphs.bucket_for(output) if self.decode_graphs else None
        if size is None:
            inputs = self.inputs.build(output)
            if self.loras is not None:
                self.loras.set_step(output.scheduled)
            return inputs, self._forward(inputs)()
        return self.decode_graphs.run(output, size)

    def _forward(self, inputs: StepInputs):
        """The forward pass over `inputs` as a zero-argument call (plan built now)."""
        plan = self.backend.plan(inputs.meta)
        return lambda: self.model(inputs.input_ids, inputs.positions, self.kv_caches, plan)

    @torch.inference_mode()
    def build_decode_graphs(self, *, capture: bool = True) -> DecodeGraphs:
        """Decode graphs at every size up to the largest batch a step can hold (capture
        False: the same path without graphs, for CPU tests)."""
        if self.config.backend_name != "triton":
            raise ValueError("CUDA graphs need attention_backend triton (its plan reads "
                             "nothing from the device, its store skips padding rows)")
        largest = min(self.config.cuda_graph_max_batch_size, self.config.max_num_seqs,
                      self.config.max_num_batched_tokens)
        return DecodeGraphs(self.inputs, self._forward, capture_sizes(largest), capture=capture)

    def _load_draft_model(self) -> LlamaForCausalLM:
        """The draft model, loaded before the pool is sized (its weights are counted in
        the profiled peak); refused unless it shares the vocabulary and reaches
        max_model_len."""
        config = self.config
        model = load_model(config.draft_model, dtype=config.draft_torch_dtype,
                           device=self.device,
                           attention_backend=config.backend_name,
                           weight_format=config.draft_weight_format)
        if model.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is not "
                             f"the model's ({self.model_config.vocab_size}); change "
                             "speculative_draft_model")
        if model.config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"the draft model reaches {model.config.max_position_embeddings} "
                             f"positions, fewer than max_model_len={self.max_model_len}; "
                             "change speculative_draft_model or lower max_model_len")
        return model

    def _draft_proposer(self, model: LlamaForCausalLM) -> DraftModelProposer:
        """The draft model with a KV pool of as many blocks as the target's (its own bytes
        a block) and input buffers for catching up whole sequences."""
        config = self.config
        kv_caches = allocate_kv_caches(model.config, self.capacity.num_blocks,
                                       config.block_size, config.draft_torch_kv_dtype,
                                       self.device)
        builder = StepInputBuilder(  # a catch-up pass may hold every drafting sequence
            max_num_batched_tokens=self.max_model_len * config.speculative_max_running,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            block_size=config.block_size, device=self.device)
        return DraftModelProposer(model, kv_caches, builder)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's "
                             f"max_position_embeddings={limit}; lower max_model_len")
        return wanted

    def _size_kv_pool(self, draft_model: LlamaForCausalLM | None) -> kv_sizing.KVCapacity:
        """The pool's blocks; a block's bytes count the draft model's pool too (it has as
        many blocks as the target's)."""
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size,
                                       self.config.torch_kv_dtype)
        if draft_model is not None:
            per_block += kv_bytes_per_block(draft_model.config, self.config.block_size,
                                            self.config.draft_torch_kv_dtype)
        capacity = kv_sizing.KVCapacity(self._num_blocks(per_block), self.config.block_size,
                                        self.max_model_len)
        kv_sizing.check_capacity(capacity, device_is_cuda=self.config.is_cuda)
        kv_sizing.log_capacity(capacity, per_block,
                               str(self.config.torch_kv_dtype).removeprefix("torch."))
        return capacity

    def _num_blocks(self, bytes_per_block: int) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if not self.config.is_cuda:
            return kv_sizing.num_blocks_for_cpu(self.config.kv_cache_gib, bytes_per_block)
        return self._num_blocks_by_profiling(bytes_per_block)

    def _num_blocks_by_profiling(self, bytes_per_block: int) -> int:
        """Run the largest step once on a scratch pool and measure the peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        step = profiling_step(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                              self.config.block_size, self.max_model_len)
        scratch = allocate_kv_caches(self.model_config, step.num_blocks, self.config.block_size,
                                     self.config.torch_kv_dtype, self.device)
        self.kv_caches = scratch
        self.execute(step.output)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        logger.info("profiling step: peak torch memory %.2f GiB", peak / kv_sizing.GIB)
        return kv_sizing.num_blocks_for_gpu(
            total_bytes=total, memory_utilization=self.config.memory_utilization,
            peak_torch_bytes=peak, non_torch_bytes=max(0, non_torch),
            bytes_per_block=bytes_per_block)
