"""Benchmark prompts whose token counts are exact under the model's tokenizer.

A prompt is a run of whole-word tokens (" apple", " river", ...): a byte-level BPE
pre-tokenizer splits text at each leading space, so the text of such a run encodes
back to exactly the same ids. That lets the benchmark send plain text (which any
OpenAI-compatible server accepts) and still know each prompt's length to the token.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, replace

WORD_TOKEN = re.compile(r"Ġ[a-z]{3,}")  # "Ġ" is the byte-level BPE mark of a leading space


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: what to send and how long it is."""

    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    sampling: tuple[tuple[str, float], ...] = ()
    """Sampling fields of the request body (("temperature", 1.0), ...); greedy when empty."""


class PromptMaker:
    """Makes prompts of exact token lengths from one tokenizer, reproducibly (seeded)."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        vocab = tokenizer.get_vocab()
        self.word_ids = sorted(i for w, i in vocab.items() if WORD_TOKEN.fullmatch(w))
        if not self.word_ids:
            raise ValueError("the tokenizer has no whole-word tokens to build prompts from")

    def random_ids(self, num_tokens: int) -> list[int]:
        return [self.rng.choice(self.word_ids) for _ in range(num_tokens)]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def count(self, text: str) -> int:
        """Tokens of `text` as the server will count them (no special tokens added)."""
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt(self, ids: list[int], max_tokens: int, as_ids: bool) -> BenchRequest:
        return BenchRequest(ids if as_ids else self.text(ids), len(ids), max_tokens)

    def random_requests(self, num: int, input_len: int, output_len: int,
                        range_ratio: float = 0.0, as_ids: bool = False) -> list[BenchRequest]:
        """`num` random prompts of `input_len` tokens (uniform within +-range_ratio)."""
        return [self.prompt(self.random_ids(self._length(input_len, range_ratio)),
                            self._length(output_len, range_ratio), as_ids) for _ in range(num)]

    def fixed_requests(self, num: int, input_len: int, output_len: int,
                       as_ids: bool = False) -> list[BenchRequest]:
        """The same prompt `num` times."""
        ids = self.random_ids(input_len)
        return [self.prompt(ids, output_len, as_ids) for _ in range(num)]

    def shared_prefix_requests(self, num: int, prefix_len: int, question_len: int,
                               output_len: int, as_ids: bool = False) -> list[BenchRequest]:
        """One common system prompt of `prefix_len` tokens + a distinct question each."""
        prefix = self.random_ids(prefix_len)
        return [self.prompt(prefix + self.random_ids(question_len), output_len, as_ids)
                for _ in range(num)]

    def mixed_requests(self, num: int, input_range: tuple[int, int],
                       output_range: tuple[int, int], as_ids: bool = False
                       ) -> list[BenchRequest]:
        """`num` prompts whose input and output lengths are log-uniform in the (inclusive)
        ranges: many short requests and a few long ones, as in real traffic."""
        return [self.prompt(self.random_ids(self._log_uniform(*input_range)),
                            self._log_uniform(*output_range), as_ids) for _ in range(num)]

    def _log_uniform(self, low: int, high: int) -> int:
        if not 1 <= low <= high:
            raise ValueError(f"a length range needs 1 <= low <= high, got ({low}, {high})")
        return min(high, int(math.exp(self.rng.uniform(math.log(low), math.log(high + 1)))))

    def _length(self, mean: int, range_ratio: float) -> int:
        if range_ratio <= 0:
            return mean
        low, high = max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio))
        return self.rng.randint(low, max(low, high))


def load_prompt_maker(model: str = "smollm2-135m-instruct", seed: int = 0) -> PromptMaker:
    """A PromptMaker over the tokenizer of `model` (a Conveyor model setting)."""
    from conveyor.common.models import load_tokenizer, resolve_model

    return PromptMaker(load_tokenizer(resolve_model(model)), seed)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One named workload, run the same way against every system."""

    name: str
    concurrency: int
    num_requests: int
    prefix_len: int = 0
    """Tokens of a system prompt before each request's own input_len tokens: one shared by
    every request (cached by the warm-up request), or each request's own with `cold_prefix`."""
    cold_prefix: bool = False
    mixed: bool = False
    """Input and output lengths log-uniform in the profile's mixed ranges, EOS allowed (else
    input_len in, exactly output_len out, ignore_eos)."""
    sampling: tuple[tuple[str, float], ...] = ()
    """The requests' sampling fields (greedy when empty)."""

    @property
    def ignore_eos(self) -> bool:
        return not self.mixed


@dataclass(frozen=True, slots=True)
class Profile:
    """How big a suite run is: its named scenarios and the sizes of its other parts."""

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
    kv_requests: int
    """KV occupancy: requests of the mixed-length workload driven through the scheduler."""
    chunk_budget: int
    """Chunked prefill: max_num_batched_tokens with it on; a long prompt of long_prompt_len
    arrives while num_streams decode."""
    long_prompt_len: int
    num_streams: int
    roofline_tokens: tuple[int, ...]
    roofline_min_time_s: float

    def scenario(self, name: str) -> Scenario:
        return next(s for s in self.scenarios if s.name == name)


SAMPLED = (("temperature", 1.0),)
"""The sampled scenarios' requests: the OpenAI API's default temperature."""

FULL = Profile(
    name="full", input_len=256, output_len=64,
    scenarios=(Scenario("c1", 1, 4), Scenario("c16", 16, 64),
               Scenario("c16-prefix", 16, 64, prefix_len=512),
               Scenario("mixed", 16, 64, mixed=True), Scenario("c64", 64, 128),
               Scenario("c64-prefix", 64, 128, prefix_len=512),
               Scenario("c1-prefix", 1, 4, prefix_len=1000),
               Scenario("c1-prefix-cold", 1, 4, prefix_len=1000, cold_prefix=True),
               Scenario("c16-sampled", 16, 64, sampling=SAMPLED),
               Scenario("c64-sampled", 64, 128, sampling=SAMPLED)),
    mixed_input=(16, 1024), mixed_output=(8, 160), system_budget_s=600.0,
    scenario_duration_s=120.0,
    variant_scenarios=("c1", "c16", "c16-prefix"), hf_scenarios=("c1", "c16", "mixed", "c64"),
    kv_requests=400, chunk_budget=256, long_prompt_len=2000, num_streams=4,
    roofline_tokens=(1, 16, 64, 256, 512), roofline_min_time_s=0.3,
)

QUICK = Profile(
    name="quick", input_len=64, output_len=8,
    scenarios=(Scenario("c1", 1, 2), Scenario("c16", 16, 16),
               Scenario("c16-prefix", 16, 16, prefix_len=128),
               Scenario("mixed", 16, 16, mixed=True),
               Scenario("c1-prefix", 1, 2, prefix_len=256),
               Scenario("c1-prefix-cold", 1, 2, prefix_len=256, cold_prefix=True),
               Scenario("c16-sampled", 16, 16, sampling=SAMPLED)),
    mixed_input=(8, 256), mixed_output=(2, 32), system_budget_s=90.0,
    scenario_duration_s=30.0,
    variant_scenarios=("c1", "c16"), hf_scenarios=("c1", "c16", "mixed"),
    kv_requests=100, chunk_budget=128, long_prompt_len=768, num_streams=2,
    roofline_tokens=(1, 64, 512), roofline_min_time_s=0.05,
)


def scenario_requests(maker: PromptMaker, profile: Profile, scenario: Scenario,
                      seed: int) -> list[BenchRequest]:
    """The warm-up request followed by the `num_requests` measured ones."""
    requests = _requests(maker, profile, scenario, seed)
    return [replace(r, sampling=scenario.sampling) for r in requests] if scenario.sampling \
        else requests


def _requests(maker: PromptMaker, profile: Profile, scenario: Scenario,
              seed: int) -> list[BenchRequest]:
    seeded = PromptMaker(maker.tokenizer, seed)
    num = scenario.num_requests + 1
    if scenario.mixed:
        return seeded.mixed_requests(num, profile.mixed_input, profile.mixed_output)
    if scenario.cold_prefix:
        return [seeded.shared_prefix_requests(1, scenario.prefix_len, profile.input_len,
                                              profile.output_len)[0] for _ in range(num)]
    if scenario.prefix_len:
        return seeded.shared_prefix_requests(num, scenario.prefix_len, profile.input_len,
                                             profile.output_len)
    return seeded.random_requests(num, profile.input_len, profile.output_len)
