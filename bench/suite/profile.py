"""How big a suite run is: the full profile and the quick one (`--quick`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """Sizes of every workload of one suite run."""

    name: str
    concurrency_levels: tuple[int, ...]
    input_len: int
    output_len: int
    prompts_per_slot: int
    """Requests per concurrency level = prompts_per_slot x concurrency (at least min_prompts)."""
    min_prompts: int
    level_duration_s: float
    """No new request starts after this long at one level (the ones in flight finish)."""
    sweep_budget_s: float
    """A sweep starts no new level after this long (on a loaded machine the levels left are
    skipped and reported, rather than the suite running for hours)."""
    prefix_len: int
    prefix_question_len: int
    prefix_requests: int
    chunk_budget: int
    """max_num_batched_tokens with chunked prefill on."""
    long_prompt_len: int
    num_streams: int
    roofline_tokens: tuple[int, ...]
    roofline_min_time_s: float
    kv_requests: int

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * concurrency)


FULL = Profile(
    name="full", concurrency_levels=(1, 4, 8, 16, 32, 64), input_len=256, output_len=64,
    prompts_per_slot=2, min_prompts=4, level_duration_s=45.0, sweep_budget_s=480.0,
    prefix_len=1000, prefix_question_len=24, prefix_requests=5,
    chunk_budget=256, long_prompt_len=2000, num_streams=4,
    roofline_tokens=(1, 16, 64, 256, 512), roofline_min_time_s=0.3, kv_requests=400,
)

QUICK = Profile(
    name="quick", concurrency_levels=(1, 4), input_len=64, output_len=16,
    prompts_per_slot=2, min_prompts=3, level_duration_s=10.0, sweep_budget_s=90.0,
    prefix_len=1000, prefix_question_len=16, prefix_requests=2,
    chunk_budget=128, long_prompt_len=768, num_streams=2,
    roofline_tokens=(1, 64, 512), roofline_min_time_s=0.05, kv_requests=100,
)
