"""The engine's one configuration, frozen: what the runner builds and the scheduler runs by.

EngineSettings map onto it once (engine_factory.engine_config). Two facts only the model and
the memory tell, `max_model_len` and `num_blocks`, may be None there: the model runner
resolves them (its max_model_len, its capacity) and the scheduler gets the resolved copy
(`dataclasses.replace`), which it checks with `validate(resolved=True)`. Torch-free: the
dtype properties import torch only when the runner reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.engine.core.errors import InvalidEngineConfig, KVCacheTooSmall

if TYPE_CHECKING:
    import torch

CPU_DTYPES = ("float32", "bfloat16")
GPU_DTYPES = ("bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "float16")
"""The KV pool's element type: auto (the model dtype), or float16 on CPU (half the bytes a
decode step reads from the pool and twice the blocks in the same memory; the attention
kernels widen each element to fp32 as they read it)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The model, the device, the KV pool and how much one step may hold."""

    model: str = ""
    """An HF folder or a .gguf file (converted once into the cache)."""
    device: str = "cpu"
    """"cpu" or a CUDA device such as "cuda" / "cuda:0"."""
    dtype: str = "float32"
    """Weights and (kv_cache_dtype auto) KV cache: float32 or bfloat16 on CPU; bfloat16 or
    float16 on GPU."""
    kv_cache_dtype: str = "auto"
    """One of KV_CACHE_DTYPES."""
    weight_format: str = "fp32"
    """What decode steps read: fp32, or a format of model/quantized_linear.py (CPU, float32)."""
    attention_backend: str | None = None
    """Backend name (attention/registry.py); None picks triton on CUDA, torch on CPU."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int | None = None
    """Most tokens (prompt + output) one request may reach; None: the model's
    max_position_embeddings (resolved by the runner)."""
    num_blocks: int | None = None
    """KV blocks in the pool; None: sized by the runner (kv_cache_gib on CPU, what is left of
    memory_utilization x device memory on a GPU, over the bytes of one block)."""
    kv_cache_gib: float = 1.0
    """CPU only: memory given to the KV pool."""
    memory_utilization: float = 0.9
    """GPU only: fraction of device memory the engine may use (weights, activations, KV)."""
    max_num_seqs: int = 64
    """Most requests running at once (in one step's batch)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by prefill chunks and decode tokens."""
    long_prefill_token_threshold: int | None = None
    """Most prompt tokens one request may take in a step (None: up to the budget), so a long
    prompt cannot crowd out other requests' prefills."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests whose token prefixes (and cache salts) match."""
    max_num_waiting_seqs: int | None = None
    """Most requests in the waiting queue (None: no limit); see WaitingBounds."""
    max_num_waiting_tokens: int | None = None
    """Most tokens the waiting requests may still have to compute (None: no limit); at
    least max_model_len, so one request always fits an empty queue."""
    seed: int | None = None
    """Seed of the sampler's shared generator (requests without their own seed)."""
    num_speculative_tokens: int = 0
    """Most draft tokens a decoding request is verified with per step (0: no speculation);
    see conveyor.engine.spec."""
    speculative_method: str = "ngram"
    """Who proposes drafts: "ngram" (the scheduler, by prompt lookup) or "draft" (a draft
    model in the runner, in the slots the scheduler leaves)."""
    ngram_min: int = 2
    ngram_max: int = 4
    """The n-gram lengths the prompt-lookup proposer matches, longest first."""
    speculative_max_running: int = 4
    """Speculate only while at most this many requests run (the most a draft model drafts
    for in one step): a larger batch already reads each weight once for many tokens."""
    draft_model: str | None = None
    """Speculative decoding with a draft model: its path (often `model` itself, in a cheaper
    `draft_weight_format`); None: no draft model."""
    draft_weight_format: str = "fp32"
    """What the draft model's steps read (a format of model/quantized_linear.py)."""
    cuda_graphs: bool = True
    """GPU with the triton backend: replay decode steps from CUDA graphs captured at start."""
    cuda_graph_max_batch_size: int = 256
    """Largest decode batch captured (also capped by max_num_seqs); larger steps run eagerly."""
    max_loras: int = 0
    """LoRA: adapter slots of every adapted projection, the most distinct adapters among the
    running requests (0: no LoRA projections at all)."""
    max_lora_rank: int = 16
    """LoRA: the largest adapter rank (each slot is this wide)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_blocks or 0) * self.block_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-(self.max_model_len or 0) // self.block_size)

    @property
    def is_cuda(self) -> bool:
        return self.device.split(":")[0] == "cuda"

    @property
    def backend_name(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if self.is_cuda else "torch"

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need a device, and a backend that plans without reading the device; LoRA
        steps run eagerly (which slots a step reaches changes its ops)."""
        return (self.cuda_graphs and self.is_cuda and self.backend_name == "triton"
                and not self.max_loras)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        import torch

        return self.torch_dtype if self.kv_cache_dtype == "auto" else getattr(torch,
                                                                                self.kv_cache_dtype)

    @property
    def draft_torch_dtype(self) -> torch.dtype:
        """The draft model's dtype: the model's, or float32 for a quantized weight format
        (whose kernels are float32 only), e.g. beside a bfloat16 model."""
        import torch

        return self.torch_dtype if self.draft_weight_format == "fp32" else torch.float32

    @property
    def draft_torch_kv_dtype(self) -> torch.dtype:
        import torch

        return (self.draft_torch_dtype if self.kv_cache_dtype == "auto"
                else getattr(torch, self.kv_cache_dtype))

    def validate(self, resolved: bool = False) -> None:
        """Raise InvalidEngineConfig naming the setting to change when a value is out of
        range; KVCacheTooSmall when the pool cannot hold one max_model_len sequence.
        `resolved`: max_model_len and num_blocks must be known (the scheduler's copy)."""
        if resolved and (self.max_model_len is None or self.num_blocks is None):
            raise InvalidEngineConfig("the scheduler needs max_model_len and num_blocks "
                                      "resolved by the model runner")
        _check_ranges(self)
        _check_device(self)
        if self.max_model_len and self.num_blocks and self.max_blocks_per_seq > self.num_blocks:
            raise KVCacheTooSmall(
                f"the KV cache holds {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.kv_capacity_tokens} tokens, fewer than one max_model_len="
                f"{self.max_model_len} sequence needs ({self.max_blocks_per_seq} blocks); "
                f"increase kv_cache_gib (CPU), memory_utilization (GPU) or num_kv_blocks, "
                f"or lower max_model_len")


def _check_ranges(config: EngineConfig) -> None:
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                 "cuda_graph_max_batch_size", "max_lora_rank"):
        value = getattr(config, name)
        if value < 1:
            raise InvalidEngineConfig(f"{name} must be at least 1, got {value}")
    for name in ("num_blocks", "max_model_len", "long_prefill_token_threshold",
                 "max_num_waiting_seqs", "max_num_waiting_tokens"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise InvalidEngineConfig(f"{name} must be None or at least 1, got {value}")
    for name in ("num_speculative_tokens", "speculative_max_running", "max_loras"):
        value = getattr(config, name)
        if value < 0:
            raise InvalidEngineConfig(f"{name} must be at least 0, got {value}")
    if config.speculative_method not in ("ngram", "draft"):
        raise InvalidEngineConfig(f"speculative_method must be ngram or draft, got "
                                  f"{config.speculative_method!r}")
    if not 1 <= config.ngram_min <= config.ngram_max:
        raise InvalidEngineConfig(f"need 1 <= ngram_min ({config.ngram_min}) <= ngram_max "
                                  f"({config.ngram_max})")
    if not 0.0 < config.memory_utilization <= 1.0:
        raise InvalidEngineConfig(f"memory_utilization must be in (0, 1], "
                                  f"got {config.memory_utilization}")
    bound, max_model_len = config.max_num_waiting_tokens, config.max_model_len
    if bound is not None and max_model_len is not None and bound < max_model_len:
        raise InvalidEngineConfig(
            f"max_num_waiting_tokens ({bound}) must be at least max_model_len "
            f"({max_model_len}), or a long prompt could never be queued; raise "
            f"CONVEYOR_ENGINE_MAX_NUM_WAITING_TOKENS (0: no limit)")


def _check_device(config: EngineConfig) -> None:
    """The dtype, weight format and options the device has kernels for."""
    allowed = GPU_DTYPES if config.is_cuda else CPU_DTYPES
    if config.dtype not in allowed:
        raise InvalidEngineConfig(f"dtype {config.dtype!r} is not supported on "
                                  f"{config.device}; choose one of {allowed}")
    if config.weight_format != "fp32" and (config.is_cuda or config.dtype != "float32"):
        raise InvalidEngineConfig(
            f"weight_format {config.weight_format!r} has kernels on the CPU in float32 only, "
            f"not {config.dtype} on {config.device}; change weight_format to fp32")
    if config.draft_model and config.is_cuda:
        raise InvalidEngineConfig(
            "speculative_method draft runs on the CPU only for now (on a GPU the profiling "
            "step that sizes the KV pool does not run the draft model); change "
            "speculative_method to ngram")
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidEngineConfig(f"kv_cache_dtype {config.kv_cache_dtype!r} is not one of "
                                  f"{KV_CACHE_DTYPES}")
    if config.kv_cache_dtype != "auto" and config.is_cuda:
        raise InvalidEngineConfig(
            f"kv_cache_dtype {config.kv_cache_dtype} is a CPU option; on {config.device} the "
            "KV pool takes the model dtype: change kv_cache_dtype to auto")
