"""Builds an EngineCore from EngineSettings: model, KV pool, scheduler (slow: loads weights)."""

from __future__ import annotations

import dataclasses
import logging
import re

from conveyor.common.models import load_tokenizer, resolve_model
from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.lora.adapter_store import AdapterStore
from conveyor.engine.settings import EngineSettings
from conveyor.engine.structured.grammar_compiler import GrammarCompiler, grammar_tokenizer

log = logging.getLogger("conveyor.engine")


def build_engine_core(settings: EngineSettings) -> EngineCore:
    """Load the model, size the KV pool and set up the scheduler over it, and the grammar
    compiler of structured outputs over the model's tokenizer.

    Raises ValueError naming the setting to change (dtype for the device, a KV
    pool smaller than one max_model_len sequence, ...).
    """
    import torch

    from conveyor.engine.model.quantized_linear import describe_weight_format
    from conveyor.engine.worker.model_runner import ModelRunner

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        runner = ModelRunner(engine_config(settings))
        config = resolved_config(settings, runner.config, runner.max_model_len,
                                 runner.capacity.num_blocks)
    except ValueError as exc:
        raise ValueError(_in_setting_names(str(exc))) from exc
    info = _engine_info(settings, config, runner)
    scheduler = Scheduler(config, info.eos_token_ids)
    grammars = _grammar_compiler(settings, info)
    log.info("engine %s: %s on %s (%s, %s attention, weights %s), max_model_len %d, "
             "KV %d tokens in %s", info.engine_id, info.model, runner.config.device, info.dtype,
             info.attention_backend, describe_weight_format(runner.model),
             info.max_model_len, info.kv_capacity_tokens,
             str(runner.config.torch_kv_dtype).removeprefix("torch."))
    if not runner.config.is_cuda:
        from conveyor.engine.model.cpu_paths import describe_cpu_paths

        log.info("engine %s kernels: %s", info.engine_id,
                 describe_cpu_paths(runner.model, runner.backend, runner.config.torch_dtype))
    return EngineCore(scheduler, runner, info, grammars, settings.grammar_compile_timeout_s,
                      _adapter_store(settings, runner))


def _adapter_store(settings: EngineSettings, runner) -> AdapterStore | None:
    if not settings.enable_lora:
        return None
    return AdapterStore(runner.model_config, settings.max_lora_rank, settings.max_cpu_loras)


def _grammar_compiler(settings: EngineSettings, info: EngineInfo) -> GrammarCompiler:
    """Structured outputs over the model's own tokenizer (mask bits: its vocabulary)."""
    tokenizer = load_tokenizer(resolve_model(settings.model))
    return GrammarCompiler(grammar_tokenizer(tokenizer, info.vocab_size, info.eos_token_ids),
                           settings.grammar_compile_threads, settings.grammar_cache_size)


_ADVICE = re.compile(r"\b(raise|lower|increase|decrease|change) "
                     r"(kv_cache_gib|memory_utilization|max_model_len|dtype|block_size"
                     r"|weight_format|kv_cache_dtype|speculative_method)\b")


def _in_setting_names(message: str) -> str:
    """An error message's advice with the CONVEYOR_ENGINE_* setting to change."""
    return _ADVICE.sub(lambda m: f"{m[1]} CONVEYOR_ENGINE_{m[2].upper()}", message)


def engine_config(settings: EngineSettings) -> EngineConfig:
    """The settings mapped onto the engine's one config (max_model_len and num_blocks None
    unless set: the runner resolves them)."""
    return EngineConfig(
        model=settings.model,
        device=settings.resolved_device(),
        dtype=settings.resolved_dtype(),
        weight_format=settings.resolved_weight_format(),
        kv_cache_dtype=settings.resolved_kv_cache_dtype(),
        attention_backend=settings.resolved_attention_backend(),
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        num_blocks=settings.num_kv_blocks,
        kv_cache_gib=settings.kv_cache_gib,
        memory_utilization=settings.memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_num_waiting_seqs=settings.max_num_waiting_seqs or None,
        seed=settings.seed,
        num_speculative_tokens=settings.num_speculative_tokens,
        speculative_method=settings.speculative_method,
        ngram_min=settings.ngram_prompt_lookup_min,
        ngram_max=settings.ngram_prompt_lookup_max,
        speculative_max_running=settings.speculative_max_running,
        draft_model=settings.resolved_draft_model(),
        draft_weight_format=settings.speculative_draft_weight_format,
        cuda_graphs=settings.cuda_graphs,
        cuda_graph_max_batch_size=settings.cuda_graph_max_batch_size,
        max_loras=settings.max_loras if settings.enable_lora else 0,
        max_lora_rank=settings.max_lora_rank,
    )


def resolved_config(settings: EngineSettings, config: EngineConfig, max_model_len: int,
                    num_blocks: int) -> EngineConfig:
    """`config` with what the runner found (max_model_len, num_blocks) and the waiting-token
    bound that defaults from max_model_len: the scheduler's copy."""
    return dataclasses.replace(
        config, max_model_len=max_model_len, num_blocks=num_blocks,
        max_num_waiting_tokens=settings.resolved_max_num_waiting_tokens(max_model_len))


def _engine_info(settings: EngineSettings, config: EngineConfig, runner) -> EngineInfo:
    model_config = runner.model_config
    return EngineInfo(
        model=settings.model_name,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        vocab_size=model_config.vocab_size,
        attention_backend=config.backend_name,
        dtype=config.dtype,
        engine_id=settings.resolved_engine_id(),
        eos_token_ids=tuple(model_config.eos_token_ids),
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank if config.max_loras else 0,
    )
