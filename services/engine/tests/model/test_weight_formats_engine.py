"""The offline engine on the bundled SmolLM2 with each opt-in weight format, and in bfloat16
(dtype auto's choice on a CPU with native bf16): greedy output against fp32's over fixed prompts
(it can't be token-exact in general: summation order and, for fp16, q8_0 and bf16, rounding
differ), and the active format reported."""

from __future__ import annotations

import pytest

from conveyor.engine.model.block_weights import FormatUnavailable, block_kernels

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def quicksort(arr):\n    ",
           "Why is the sky blue?", "1, 1, 2, 3, 5, 8, 13,", "List five fruits that are red:",
           "Once upon a time, in a village at the edge of a forest,",
           "Give me a recipe for pancakes.", "The best way to learn a new language is"]
NUM_TOKENS = 24
MIN_AGREEMENT = {"q4_1": 0.9, "fp16": 0.9, "q8_0": 0.25, "q4_1_int8": 0.1}
MIN_BF16_AGREEMENT = 0.3
"""The same for the model in bfloat16: 50% on these prompts when measured (43.8% over
the former bench/weight_formats.py's 16 x 64)."""
"""Least share of tokens equal to fp32's before the first divergence. Measured with
the former bench/weight_formats.py (16 prompts x 64 tokens): q4_1 and fp16 100%; q8_0 44%, since it
re-rounds the checkpoint's Q4_1 values to 8-bit blocks of another grid; q4_1_int8 22.5%,
since it rounds every activation block to int8."""


def _greedy(weight_format: str, dtype: str = "float32") -> tuple[list[list[int]], str]:
    from conveyor.engine import LLM, SamplingParams
    from conveyor.engine.model.quantized_linear import describe_weight_format

    llm = LLM(weight_format=weight_format, dtype=dtype, torch_threads=1, num_kv_blocks=64,
              max_model_len=256, max_num_seqs=len(PROMPTS))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outputs],
            describe_weight_format(llm.core.runner.model))


@pytest.fixture(scope="module")
def fp32_outputs(smollm2_folder) -> list[list[int]]:
    outputs, active = _greedy("fp32")
    assert active.startswith("fp32,")
    return outputs


def _agreement_before_divergence(ours: list[list[int]], reference: list[list[int]]) -> float:
    equal = 0
    for a, b in zip(ours, reference, strict=True):
        equal += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
    return equal / sum(len(b) for b in reference)


@pytest.mark.parametrize("weight_format", ["q4_1", "fp16", "q8_0", "q4_1_int8"])
def test_format_agrees_with_fp32(weight_format: str, fp32_outputs) -> None:
    if weight_format != "fp16":
        try:
            block_kernels()
        except FormatUnavailable as exc:
            pytest.skip(f"block kernels unavailable here: {exc}")
    outputs, active = _greedy(weight_format)
    assert active.startswith(weight_format)
    assert _agreement_before_divergence(outputs, fp32_outputs) >= MIN_AGREEMENT[weight_format]


def test_bf16_agrees_with_fp32(fp32_outputs) -> None:
    """bf16 weights, activations and KV pool: every layer's output rounded to 8 bits of
    mantissa, so greedy output leaves fp32's after a few dozen tokens (the former weight_formats,
    16 prompts x 64 tokens: 43.8% before the first divergence, perplexity 18.913 vs 18.907)."""
    outputs, active = _greedy("fp32", dtype="bfloat16")
    assert active.startswith("bf16,")
    assert _agreement_before_divergence(outputs, fp32_outputs) >= MIN_BF16_AGREEMENT
