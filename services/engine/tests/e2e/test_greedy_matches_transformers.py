"""The offline API's greedy output equals transformers' greedy `generate`, token for token,
on the bundled SmolLM2: alone, batched with other requests, with chunked prefill, after a
prefix-cache hit and after a preemption."""

from __future__ import annotations

import gc

import pytest

from conveyor.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _make_llm(support, **settings) -> LLM:
    """float32, the dtype transformers runs here (dtype auto is bfloat16 on a CPU with AMX or
    AVX512-BF16; its agreement with fp32: test_weight_formats_engine.py, not parity)."""
    return LLM(support.model, dtype="float32", torch_threads=support.torch_threads, **settings)


@pytest.fixture(scope="module")
def llm(engine_test_support):
    llm = _make_llm(engine_test_support, max_model_len=2048, kv_cache_gib=0.25)
    yield llm
    del llm
    gc.collect()


def len_of(case) -> int:
    return len(case.token_ids)


def _greedy(support) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=support.max_tokens)


def _distractors() -> list[tuple[list[int], SamplingParams]]:
    """Other traffic: sampled requests of various lengths, one with n=2."""
    prompts = [[1, 504, 2988, 288], [17, 42, 99, 1000, 2000, 3000] * 5,
               [300 + i for i in range(40)]]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=30),
              SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=7, n=2),
              SamplingParams(temperature=0.5, seed=3, max_tokens=24, ignore_eos=True)]
    return list(zip(prompts, params, strict=True))


def _run_batch(llm: LLM, support, with_distractors: bool = True, cases=None):
    """The cases in one generate call (interleaved with distractors); name -> RequestOutput."""
    cases = cases or support.cases
    items = [{"prompt_token_ids": c.token_ids} for c in cases]
    params = [_greedy(support)] * len(cases)
    if with_distractors:
        for i, (prompt, sampling) in enumerate(_distractors()):
            items.insert(2 * i + 1, {"prompt_token_ids": prompt})
            params.insert(2 * i + 1, sampling)
    outputs = llm.generate(items, params, use_tqdm=False)
    by_ids = {tuple(o.prompt_token_ids): o for o in outputs}
    return {c.name: by_ids[tuple(c.token_ids)] for c in cases}


def _assert_matches(outputs, hf_greedy):
    mismatches = {name: (o.outputs[0].token_ids, hf_greedy[name])
                  for name, o in outputs.items() if o.outputs[0].token_ids != hf_greedy[name]}
    assert not mismatches, f"engine vs transformers: {mismatches}"


def test_the_prompts_cover_chat_plain_short_and_long(engine_test_support):
    cases = engine_test_support.cases
    assert len(cases) >= 8
    assert sum(c.chat is not None for c in cases) >= 4
    assert max(len(c.token_ids) for c in cases) > 1000
    assert min(len(c.token_ids) for c in cases) < 10


def test_each_prompt_alone(llm, engine_test_support, hf_greedy):
    outputs = {}
    for case in engine_test_support.cases:
        if case.chat is not None:
            [output] = llm.chat(case.chat, _greedy(engine_test_support))
        else:
            [output] = llm.generate(case.text, _greedy(engine_test_support))
        assert output.prompt_token_ids == case.token_ids
        outputs[case.name] = output
    _assert_matches(outputs, hf_greedy)
    finished = outputs["chat0"].outputs[0]
    assert finished.text and finished.finish_reason in ("stop", "length")


def test_batched_with_other_requests(llm, engine_test_support, hf_greedy):
    _assert_matches(_run_batch(llm, engine_test_support), hf_greedy)


def test_after_a_prefix_cache_hit(llm, engine_test_support, hf_greedy):
    _run_batch(llm, engine_test_support, with_distractors=False)  # warm the cache
    hits_before = llm.core.stats().prefix_cache_hits
    outputs = _run_batch(llm, engine_test_support, with_distractors=False)
    assert llm.core.stats().prefix_cache_hits > hits_before
    long_case = max(engine_test_support.cases, key=lambda c: len(c.token_ids))
    assert outputs[long_case.name].num_cached_tokens >= len(long_case.token_ids) - 16
    _assert_matches(outputs, hf_greedy)


def test_with_chunked_prefill(engine_test_support, hf_greedy):
    llm = _make_llm(engine_test_support, max_model_len=2048, kv_cache_gib=0.25,
                    max_num_batched_tokens=96)
    try:
        _assert_matches(_run_batch(llm, engine_test_support), hf_greedy)
    finally:
        del llm
        gc.collect()


def test_after_a_preemption(engine_test_support, hf_greedy):
    # 69 blocks x 16 tokens. The long prompt (1080 tokens) arrives first and takes 68; the
    # shortest (1 block) takes the last one; when the long one needs its 69th block (its
    # 9th token) the pool is dry and the latest admitted request is preempted, to
    # recompute its prompt and the tokens it had generated once the long one finished.
    cases = sorted(engine_test_support.cases, key=len_of)
    cases = [cases[-1], *cases[:-1]]
    llm = _make_llm(engine_test_support, max_model_len=1100, num_kv_blocks=69, block_size=16)
    try:
        outputs = _run_batch(llm, engine_test_support, with_distractors=False, cases=cases)
        assert llm.core.stats().num_preemptions > 0
        _assert_matches(outputs, hf_greedy)
        stats = llm.core.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        del llm
        gc.collect()


def test_parallel_samples_logprobs_and_usage(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, logprobs=True,
                            top_logprobs=2, ignore_eos=True)
    prompt = "Write one word about spring: " * 4
    [first] = llm.generate(prompt, params)
    [again] = llm.generate(prompt, params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    for completion in first.outputs:
        assert len(completion.token_ids) == 4 and completion.finish_reason == "length"
        assert len(completion.logprobs) == 4
        assert all(token in position for token, position
                   in zip(completion.token_ids, completion.logprobs, strict=True))
        assert completion.cumulative_logprob < 0
    assert first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens == len(first.prompt_token_ids)
    assert again.num_cached_tokens > 0


def test_bad_prompts_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 2040], SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}])
    assert not llm.core.has_unfinished_requests
