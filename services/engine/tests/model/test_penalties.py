"""Penalties on the CPU (the entries a history names) against the tables CUDA uses."""

from __future__ import annotations

import torch

from conveyor.engine.sampling.logits_processors import (
    _apply_penalties_by_table,
    apply_penalties,
)
from conveyor.engine.sampling.sampling_batch import PenaltyInputs

VOCAB = 1000


def test_the_cpu_entries_and_the_cuda_tables_agree_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (4, 30), generator=generator)
    outputs = torch.randint(0, 40, (4, 50), generator=generator)  # repeats: counts > 1
    prompts[1, 10:] = VOCAB  # padding
    outputs[2, :] = VOCAB  # a row with no output yet
    penalties = PenaltyInputs(prompt_ids=prompts, output_ids=outputs,
                              presence=torch.tensor([0.5, 0.0, 1.0, -0.5]),
                              frequency=torch.tensor([0.25, 1.0, 0.0, 0.5]),
                              repetition=torch.tensor([1.3, 1.0, 0.8, 2.0]))
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    logits[3, 5] = float("-inf")
    by_entries, by_table = logits.clone(), logits.clone()
    apply_penalties(by_entries, penalties)
    _apply_penalties_by_table(by_table, penalties)
    assert torch.equal(by_entries, by_table)
    assert not torch.equal(by_entries, logits)
