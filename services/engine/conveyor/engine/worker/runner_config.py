"""How the model runner is set up (the engine's settings map onto this)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DTYPES = ("float32", "bfloat16")
GPU_DTYPES = ("bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "float16")
"""The KV pool's element type: auto (the model dtype), or float16 on CPU (half the bytes a
decode step reads from the pool and twice the blocks in the same memory; the attention
kernels widen each element to fp32 as they read it)."""


@dataclass(slots=True)
class RunnerConfig:
    model: str
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
    """Tokens per KV block; must equal the scheduler's block size."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None means the model's max_position_embeddings."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (sizes the input buffers and the profiling pass)."""
    max_num_seqs: int = 64
    """Requests in one step."""
    kv_cache_space_gib: float = 1.0
    """CPU only: memory given to the KV pool."""
    memory_utilization: float = 0.9
    """GPU only: fraction of device memory the engine may use (weights, activations, KV)."""
    num_blocks: int | None = None
    """Fixed KV pool size in blocks, overriding both sizing rules (tests, benchmarks)."""
    seed: int | None = None
    """Seed of the sampler's shared generator (requests without their own seed)."""
    draft_model: str | None = None
    """Speculative decoding with a draft model: its path (often `model` itself, in a cheaper
    `draft_weight_format`); None: no draft model."""
    draft_weight_format: str = "fp32"
    """What the draft model's steps read (a format of model/quantized_linear.py)."""
    draft_max_requests: int = 4
    """Most requests drafted for in one step (the scheduler's speculative_max_running)."""
    cuda_graphs: bool = True
    """GPU with the triton backend: replay decode steps from CUDA graphs captured at start."""
    cuda_graph_max_batch_size: int = 256
    """Largest decode batch captured (also capped by max_num_seqs); larger steps run eagerly."""
    max_loras: int = 0
    """LoRA: adapter slots of every adapted projection, the most adapters in one step (0:
    no LoRA projections at all)."""
    max_lora_rank: int = 16
    """LoRA: the largest adapter rank (each slot is this wide)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    @property
    def draft_torch_dtype(self) -> torch.dtype:
        """The draft model's dtype: the model's, or float32 for a quantized weight format
        (whose kernels are float32 only), e.g. beside a bfloat16 model."""
        return self.torch_dtype if self.draft_weight_format == "fp32" else torch.float32

    @property
    def draft_torch_kv_dtype(self) -> torch.dtype:
        return (self.draft_torch_dtype if self.kv_cache_dtype == "auto"
                else DTYPES[self.kv_cache_dtype])

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need a device, and a backend that plans without reading the device; LoRA
        steps run eagerly (which slots a step reaches changes its ops)."""
        return (self.cuda_graphs and self.is_cuda and self.backend_name == "triton"
                and not self.max_loras)

    @property
    def backend_name(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if self.is_cuda else "torch"

    def validate(self) -> None:
        """Raise ValueError naming the setting to change."""
        allowed = GPU_DTYPES if self.is_cuda else CPU_DTYPES
        if self.dtype not in allowed:
            raise ValueError(f"dtype {self.dtype!r} is not supported on {self.device}; "
                             f"choose one of {allowed}")
        if self.weight_format != "fp32" and (self.is_cuda or self.dtype != "float32"):
            raise ValueError(f"weight_format {self.weight_format!r} has kernels on the CPU in "
                             f"float32 only, not {self.dtype} on {self.device}; "
                             "change weight_format to fp32")
        if self.draft_model and self.is_cuda:
            raise ValueError("speculative_method draft runs on the CPU only for now (on a GPU "
                             "the profiling step that sizes the KV pool does not run the draft "
                             "model); change speculative_method to ngram")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{KV_CACHE_DTYPES}")
        if self.kv_cache_dtype != "auto" and self.is_cuda:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is a CPU option; on "
                             f"{self.device} the KV pool takes the model dtype: change "
                             "kv_cache_dtype to auto")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be at least 0 and "
                             f"max_lora_rank ({self.max_lora_rank}) at least 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be positive, "
                             f"got {self.cuda_graph_max_batch_size}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], "
                             f"got {self.memory_utilization}")
