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


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload of the peer comparison, run the same way against every system."""

    name: str
    concurrency: int
    num_requests: int
    prefix_len: int = 0
    """Tokens of one system prompt shared by every request, before its own input_len tokens."""
    mixed: bool = False
    """Input and output lengths log-uniform in the profile's mixed ranges, EOS allowed (else
    input_len in, exactly output_len out, ignore_eos)."""

    @property
    def ignore_eos(self) -> bool:
        return not self.mixed


@dataclass(frozen=True, slots=True)
class PeerProfile:
    """Sizes of the peer comparison (`run_suite.py --peers`)."""

    name: str
    input_len: int
    output_len: int
    scenarios: tuple[Scenario, ...]
    mixed_input: tuple[int, int]
    mixed_output: tuple[int, int]
    system_budget_s: float
    """A system starts no new scenario after this long (the rest are reported as skipped)."""
    scenario_duration_s: float
    """No new request of a scenario starts after this long (those in flight finish and count:
    a slow server completes fewer requests rather than running for many minutes)."""
    variant_scenarios: tuple[str, ...]
    """What Conveyor runs with an opt-in setting (e.g. a weight format): an extra row."""
    hf_scenarios: tuple[str, ...]
    """What the transformers static-batching baseline runs (it has no prefix cache)."""

    def scenario(self, name: str) -> Scenario:
        return next(s for s in self.scenarios if s.name == name)


PEERS = PeerProfile(
    name="peers", input_len=256, output_len=64,
    scenarios=(Scenario("c1", 1, 4), Scenario("c16", 16, 64),
               Scenario("c16-prefix", 16, 64, prefix_len=512),
               Scenario("mixed", 16, 64, mixed=True), Scenario("c64", 64, 128),
               Scenario("c64-prefix", 64, 128, prefix_len=512)),
    mixed_input=(16, 1024), mixed_output=(8, 160), system_budget_s=480.0,
    scenario_duration_s=120.0,
    variant_scenarios=("c1", "c16", "c16-prefix"), hf_scenarios=("c1", "c16", "mixed"),
)

PEERS_QUICK = PeerProfile(
    name="peers-quick", input_len=64, output_len=8,
    scenarios=(Scenario("c1", 1, 2), Scenario("c16", 16, 16),
               Scenario("c16-prefix", 16, 16, prefix_len=128),
               Scenario("mixed", 16, 16, mixed=True)),
    mixed_input=(8, 256), mixed_output=(2, 32), system_budget_s=90.0,
    scenario_duration_s=30.0,
    variant_scenarios=("c1", "c16"), hf_scenarios=("c1", "c16", "mixed"),
)
