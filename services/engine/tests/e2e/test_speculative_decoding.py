"""Speculative decoding on the bundled model, offline, in float32, with n-gram drafts and with
a draft model (the same model in q4_1_int8): greedy output equals the output without drafts
token for token, in fewer steps; sampled output keeps its distribution (a two-sample
chi-square over many seeds)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from conveyor.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

COPYING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river.",
    "Rename the variable x to total in this code:\n\ndef add(x, y):\n    x = x + y\n"
    "    return x\n",
    "Rewrite this JSON with the keys in upper case: {\"name\": \"Ada\", \"city\": \"Paris\", "
    "\"age\": 36}",
]


@pytest.fixture(scope="module")
def engines(engine_test_support):
    def make(**settings) -> LLM:
        return LLM(engine_test_support.model, dtype="float32", max_model_len=1536,
                   kv_cache_gib=0.2, torch_threads=engine_test_support.torch_threads,
                   max_num_seqs=64, **settings)
    engines = {"plain": make(),
               "ngram": make(num_speculative_tokens=4, speculative_max_running=64),
               "draft": make(num_speculative_tokens=3, speculative_max_running=64,
                             speculative_method="draft")}
    yield engines
    engines.clear()
    gc.collect()


def prompts(support) -> list[list[int]]:
    tokenizer = support.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True) for text in COPYING]
    chats = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return chats + [case.token_ids for case in support.cases]


def counting_steps(llm: LLM) -> list[int]:
    """Counts llm's engine steps (a list so the test reads it after generate)."""
    count = [0]
    step = llm.core.step

    def counted():
        count[0] += 1
        return step()
    llm.core.step = counted
    return count


GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
ALLOWED = [330, 331, 332, 333]
SEEDS = 400


def greedy_one_at_a_time(llm: LLM, support) -> tuple[list[list[int]], int]:
    """Each prompt's greedy output, one request at a time (c1, where speculation pays), and
    the engine steps they took."""
    outputs, steps = [], 0
    for ids in prompts(support):
        count = counting_steps(llm)
        [out] = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
        llm.core.step = type(llm.core).step.__get__(llm.core)
        steps += count[0]
        outputs.append(out.outputs[0].token_ids)
    return outputs, steps


def third_tokens(llm: LLM) -> Counter:
    """The third output token over SEEDS seeds: four tokens allowed (logit_bias) after a
    prompt that cycles through them, so n-gram drafts are proposed for any output that
    continues the cycle (a longer prompt holds no other n-grams and costs more prefill)."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True,
                             logit_bias={t: 100.0 for t in ALLOWED}) for seed in range(SEEDS)]
    outputs = llm.generate([{"prompt_token_ids": ALLOWED * 2}] * SEEDS, params, use_tqdm=False)
    return Counter(o.outputs[0].token_ids[2] for o in outputs)


@pytest.fixture(scope="module")
def plain(engines, engine_test_support) -> dict:
    """The engine without drafts, run once for both methods: greedy outputs and steps, and
    the sampled third tokens."""
    outputs, steps = greedy_one_at_a_time(engines["plain"], engine_test_support)
    return {"greedy": outputs, "steps": steps, "third_tokens": third_tokens(engines["plain"])}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_the_same_in_fewer_steps(engines, engine_test_support, plain, method):
    """n-gram: measured 285 vs 348 steps; a draft model (the same model in q4_1_int8):
    fewer still, its drafts agree with the model far more often."""
    outputs, steps = greedy_one_at_a_time(engines[method], engine_test_support)
    assert outputs == plain["greedy"]
    assert steps < 0.9 * plain["steps"], (steps, plain["steps"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_output_keeps_its_distribution(engines, plain, method):
    """The third output token's distribution over 400 seeds, with and without drafts, passes
    a two-sample chi-square at p = 0.001 (3 degrees of freedom: 16.27); the drafts were both
    kept and rejected on the way."""
    llm = engines[method]
    verified, previous = [], llm.core.timer.on_iteration
    llm.core.timer.on_iteration = verified.append
    try:
        counts = {"plain": plain["third_tokens"], method: third_tokens(llm)}
    finally:
        llm.core.timer.on_iteration = previous
    drafted = sum(stats.num_draft_tokens for stats in verified)
    accepted = sum(stats.num_accepted_tokens for stats in verified)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert set(counts["plain"]) <= set(ALLOWED) and set(counts[method]) <= set(ALLOWED)
    statistic = 0.0
    for token in ALLOWED:
        a, b = counts["plain"][token], counts[method][token]
        if a + b:
            expected = (a + b) / 2  # equal totals: each side expects half the pooled count
            statistic += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    assert statistic < 16.27, counts
