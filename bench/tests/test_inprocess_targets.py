"""bench/inprocess_targets.py without the model: the FLOP count, the bandwidth reading and the
target lines."""

import pytest
import torch

from bench import inprocess_targets as targets
from bench.kernels.model_shapes import model_flops, params_per_token

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152}


def test_model_flops_count_every_linear_layer_the_lm_head_only_for_sampled_tokens():
    params = params_per_token(SMOLLM2)
    assert params == 134_479_872 and model_flops(SMOLLM2, 100.0) == pytest.approx(2 * params * 100)
    assert targets.run_flops(SMOLLM2, 256, 0) == 2.0 * (params - 49152 * 576) * 256
    assert targets.run_flops(SMOLLM2, 0, 1) == 2.0 * params


def test_read_bandwidth_is_bytes_over_seconds():
    gb_s = targets.read_bandwidth_gb_s(torch.ones(1 << 20), repeats=2)
    assert 0.1 < gb_s < 10_000


def test_target_lines_say_met_and_not_met():
    result = {"threads": 2, "dtype": "float32", "weight_bytes": 538_000_000,
              "read_bandwidth_gb_s": 40.0, "dram_floor_ms": 13.45, "tpot_c1_ms": 15.0,
              "dram_floor_ratio": 15.0 / 13.45, "c1_pairs": [{}] * 3,
              "roofline_gflops": 400.0, "peak_square_gflops": 200.0,
              "achieved_gflops_c64": 250.0, "roofline_share": 0.625,
              "c64": {"output_throughput": 230.0}}
    text = targets.format_targets(result)
    assert "1.12x (target <= 1.15x): met" in text
    assert "62% of the roofline (target >= 80%): not met" in text
    assert "FMA peak" not in text  # a JSON from before the FMA probe
    text = targets.format_targets({**result, "fma_peak_gflops": 230.0, "fma_peak_share": 250 / 230})
    assert "FMA peak of 2 threads at once 230.0 GFLOP/s: c64 at 109% of it" in text

