"""n > 1 over gRPC: one Generate call, the prompt computed once, every chunk naming its sample."""

from __future__ import annotations

import grpc
import pytest

from conveyor.common.sampling_fields import MAX_NUM_SAMPLES
from conveyor.v1 import engine_pb2

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 and one more
MAX_TOKENS = 3


def _generate(request_id, n, **fields):
    sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                      sampling=sampling, n=n, **fields)


async def test_n_3_is_one_request_whose_prompt_is_computed_once(support):
    async with support.serve_engine(support.make_core()) as (engine, stub):
        chunks = [c async for c in stub.Generate(_generate("r", n=3))]
        stats = engine.core.stats()
        computed = engine.core.runner.num_computed_tokens
    by_index: dict[int, list[int]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert by_index == {i: [14, 15, 16] for i in range(3)}
    finals = {c.index: c for c in chunks if c.finish_reason}
    assert sorted(finals) == [0, 1, 2]
    assert {f.usage.prompt_tokens for f in finals.values()} == {13}
    assert [finals[i].usage.cached_tokens for i in range(3)] == [0, 12, 12]
    # Engine counters: prompt tokens asked of the prefix cache minus those it served is
    # what the model computed of the prompts: the prompt once, and for each further sample
    # only its last token (the logits its first draw needs).
    computed_prompt_tokens = stats.prefix_cache_queries - stats.prefix_cache_hits
    assert computed_prompt_tokens == len(PROMPT) + 2
    # The model's own count: those prompt tokens, and one per decode step of each sample.
    assert computed == computed_prompt_tokens + 3 * (MAX_TOKENS - 1)


async def test_n_1_and_unset_n_are_one_sample_with_index_0(support):
    async with support.serve_engine(support.make_core()) as (_, stub):
        for n in (0, 1):
            chunks = [c async for c in stub.Generate(_generate(f"r{n}", n=n))]
            assert {c.index for c in chunks} == {0}
            assert [t for c in chunks for t in c.token_ids] == [14, 15, 16]


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": MAX_NUM_SAMPLES + 1}, f"n must be at most {MAX_NUM_SAMPLES}"),
    ({"n": 2**32 - 1}, f"n must be at most {MAX_NUM_SAMPLES}"),
    ({"n": 2, "resume_output_token_ids": [14]}, "resume_output_token_ids needs n = 1"),
])
async def test_bad_n_is_invalid_argument(support, fields, message):
    async with support.serve_engine(support.make_core()) as (engine, stub):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [c async for c in stub.Generate(_generate("bad", **fields))]
        assert not engine.core.has_unfinished_requests
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
