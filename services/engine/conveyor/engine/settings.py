"""The engine's settings: every field is an environment variable CONVEYOR_ENGINE_<NAME>."""

from __future__ import annotations

import os
import socket

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from conveyor.common.registration_settings import RegistrationSettings
from conveyor.common.settings import ModelSettingsMixin, ServiceSettings
from conveyor.engine.idle_cores import idle_cpu_count

DEFAULT_PORT = 50052
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "native")
SPECULATIVE_METHODS = ("ngram", "draft")
WAITING_TOKENS_PER_BATCHED_TOKEN = 8
"""The default waiting-token bound in step budgets: about 8 full prefill steps queued."""


def _default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class EngineSettings(ModelSettingsMixin, RegistrationSettings, ServiceSettings):
    """Settings of one engine process (also the keyword arguments of the offline `LLM`)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_ENGINE_", extra="ignore")

    port: int = Field(DEFAULT_PORT, description="gRPC port to listen on (0 picks a free one).")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block (published to "
                            "gateways, which hash prefix hints in blocks of it).")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence in tokens, prompt + output (default: the "
        "model's); published to gateways, which check prompts against it: the one setting of it.",
    )
    max_num_seqs: int = Field(64, ge=1, description="Most requests computed in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step (prefill chunks + decode tokens)."
    )
    max_num_waiting_seqs: int = Field(
        256, ge=0, description="Most requests waiting to run (0 = no limit; 256 = 4 full batches "
        "at the default max_num_seqs); past it an arrival pushes out a lower-priority waiting "
        "request or is refused (RESOURCE_EXHAUSTED, reason queue_full).",
    )
    max_num_waiting_tokens: int | None = Field(
        None, ge=0, description="Most tokens the waiting requests may still have to compute "
        "(0 = no limit; unset = 8 x max_num_batched_tokens, about 8 full prefill steps, and at "
        "least max_model_len), shed like max_num_waiting_seqs.",
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="On CPU: memory given to KV blocks, in GiB."
    )
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="On GPU: fraction of device memory the engine may use."
    )
    dtype: str = Field(
        "auto", description="Model dtype: auto (on GPU bfloat16; on CPU bfloat16 where it has "
        "AVX512-BF16 or AMX and weight_format is fp32, else float32), float32, bfloat16, "
        "float16."
    )
    weight_format: str = Field(
        "fp32", description="Weights decode steps read (CPU, float32 only): fp32; fp16 "
        "(fbgemm); q8_0 (8-bit blocks); q4_1 (4-bit blocks, the bundled GGUF's own, lm_head "
        "q8_0); q4_1_int8 (q4_1 with activations rounded to int8 per block of 32, llama.cpp's "
        "scheme: faster, greedy output no longer fp32's). Steps of more than 8 rows (32 for "
        "q4_1_int8) stay fp32, so prefill of longer prompts does; see docs/performance.md, "
        "weight formats.",
    )
    kv_cache_dtype: str = Field(
        "auto", description="KV pool element type: auto (the model dtype); float16 (CPU: half "
        "the bytes decode attention reads and twice the blocks in kv_cache_gib; keys and values "
        "rounded to fp16, so greedy output may differ from fp32's; see docs/performance.md).",
    )
    attention_backend: str = Field(
        "auto", description="Attention backend: auto (on GPU triton; on CPU native when its "
        "C++ kernels build or are cached, else torch), torch, triton, native (CPU, float32 or "
        "bfloat16: decode and prefill attention read in place from the KV pool by C++ kernels)."
    )
    device: str = Field("auto", description="Device: auto (cuda when available), cpu, cuda.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics HTTP port (0 = off).")
    engine_id: str = Field("", description="This engine's id in the registry (empty: host-pid).")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Fixed KV pool size in blocks, overriding kv_cache_gib and "
        "memory_utilization (tests, benchmarks).",
    )
    seed: int | None = Field(None, description="Seed of the sampler for requests without one.")
    cuda_graphs: bool = Field(
        True, description="On GPU with triton attention: replay decode steps from CUDA graphs "
        "captured at start (false: every step eager).",
    )
    cuda_graph_max_batch_size: int = Field(
        256, ge=1, description="Largest decode batch captured as a CUDA graph (also capped by "
        "max_num_seqs); larger decode steps run eagerly.",
    )
    torch_threads: int | None = Field(
        None, ge=0, validate_default=True,
        description="CPU threads for torch; 0 = torch's default (all cores); unset = the cores "
        "not busy at start-up (CPU count minus the cores both the 1-minute load average and the "
        "CPU in use now by processes other than the engine's siblings show busy, at least 1): "
        "threads spinning against other processes made steps 2-7x slower.",
    )
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="Longest a structured-output constraint may take to compile; "
        "past it the request fails with INVALID_ARGUMENT (the compile itself runs on).",
    )
    grammar_compile_threads: int = Field(
        2, ge=1, description="Threads compiling structured-output constraints, off the step "
        "loop (llguidance drops the GIL while it compiles).",
    )
    grammar_cache_size: int = Field(
        256, ge=1, description="Compiled structured-output grammars kept, by (kind, text), "
        "least recently used out first.",
    )

    num_speculative_tokens: int = Field(
        0, ge=0, description="Speculative decoding: most draft tokens (proposed as "
        "speculative_method says) verified per decoding request and step (0: off). Greedy "
        "output is unchanged, sampled output keeps its distribution and a seed its tokens; "
        "see docs/architecture.md.",
    )
    speculative_method: str = Field(
        "ngram", description="Who proposes the drafts: ngram (prompt lookup, no model) or "
        "draft (a draft model: speculative_draft_model in speculative_draft_weight_format, "
        "run greedily for k steps before each verifying step; its KV pool takes as many blocks "
        "as the model's; CPU only for now).",
    )
    speculative_draft_model: str = Field(
        "", description="The draft model (a bundled name, a .gguf file or an HF folder with "
        "the model's vocabulary); empty: the served model itself.",
    )
    speculative_draft_weight_format: str = Field(
        "q4_1_int8", description="Weights the draft model's steps read (see weight_format; "
        "q4_1_int8 decodes one token ~3-4x faster than fp32 on the CPU).",
    )
    ngram_prompt_lookup_min: int = Field(
        2, ge=1, description="Shortest suffix n-gram the proposer looks up.")
    ngram_prompt_lookup_max: int = Field(
        4, ge=1, description="Longest suffix n-gram the proposer looks up (tried first).")
    speculative_max_running: int = Field(
        4, ge=1, description="Speculate only while at most this many requests run: in a "
        "larger batch each weight read already serves many tokens and drafts add compute.",
    )

    enable_lora: bool = Field(
        False, description="Serve LoRA adapters (PEFT folders named by requests, read on first "
        "use): every q/k/v/o/gate/up/down projection gets max_loras adapter slots; steps "
        "with adapter rows cost more (docs/benchmarks.md, Multi-LoRA), steps without run the "
        "base model's code (on a GPU eagerly: CUDA graphs are off with LoRA on).",
    )
    max_loras: int = Field(
        4, ge=1, description="LoRA: most distinct adapters in one step; requests of a further "
        "adapter wait until one finishes.",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="LoRA: the largest adapter rank accepted (each slot is this wide: "
        "a smaller rank computes zeros up to it).",
    )
    max_cpu_loras: int = Field(
        16, ge=1, description="LoRA: adapters kept in memory, least recently used out first "
        "(a request naming one forgotten reads its files again).",
    )

    @field_validator("torch_threads")
    @classmethod
    def _idle_cores_when_unset(cls, value: int | None) -> int:
        return idle_cpu_count() if value is None else value

    @model_validator(mode="after")
    def _ngram_bounds_in_order(self) -> EngineSettings:
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(
                f"CONVEYOR_ENGINE_NGRAM_PROMPT_LOOKUP_MIN ({self.ngram_prompt_lookup_min}) "
                f"exceeds CONVEYOR_ENGINE_NGRAM_PROMPT_LOOKUP_MAX ({self.ngram_prompt_lookup_max})")
        return self

    def resolved_draft_model(self) -> str | None:
        """The draft model's path when drafts come from one, else None."""
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        if not self.num_speculative_tokens or self.speculative_method != "draft":
            return None
        from conveyor.engine.model.quantized_linear import WEIGHT_FORMATS

        _check_choice("speculative_draft_weight_format", self.speculative_draft_weight_format,
                      WEIGHT_FORMATS)
        return self.speculative_draft_model or self.model

    def resolved_max_num_waiting_tokens(self, max_model_len: int) -> int | None:
        """The waiting-token bound (None: no limit), with the default resolved."""
        if self.max_num_waiting_tokens is None:
            return max(WAITING_TOKENS_PER_BATCHED_TOKEN * self.max_num_batched_tokens,
                       max_model_len)
        return self.max_num_waiting_tokens or None

    def resolved_engine_id(self) -> str:
        return self.engine_id or _default_engine_id()

    def resolved_device(self) -> str:
        """`device` with auto resolved; raises naming the setting when it is unknown."""
        _check_choice("device", self.device, DEVICES)
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        _check_choice("dtype", self.dtype, DTYPES)
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() != "cpu":
            return "bfloat16"
        from conveyor.engine.native.cpu_features import auto_cpu_dtype

        return auto_cpu_dtype(self.weight_format)

    def resolved_weight_format(self) -> str:
        from conveyor.engine.model.quantized_linear import WEIGHT_FORMATS

        _check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        return self.weight_format

    def resolved_kv_cache_dtype(self) -> str:
        from conveyor.engine.core.config import KV_CACHE_DTYPES

        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        return self.kv_cache_dtype

    def resolved_attention_backend(self) -> str:
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.resolved_device() != "cpu":
            return "triton"
        if self.resolved_dtype() not in ("float32", "bfloat16"):
            return "torch"
        from conveyor.engine.attention.native_kernel import native_unavailable_reason

        return "torch" if native_unavailable_reason() else "native"


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{name} {value!r} is not one of {', '.join(choices)}; "
            f"change CONVEYOR_ENGINE_{name.upper()}"
        )
