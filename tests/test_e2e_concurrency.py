"""32 concurrent streaming requests complete with the outputs each prompt gets alone."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

NUM_REQUESTS = 32
TOPICS = ["cats", "rain", "bread", "trains", "the sea", "music", "winter", "chess"]
STYLES = ["one fact about", "a word that rhymes with", "a question about", "a color for"]
PROMPTS = [f"Tell me {style} {topic}." for style in STYLES for topic in TOPICS]


async def _stream_text(client, prompt: str) -> tuple[str, str]:
    text, finish = "", None
    stream = await client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompt}],
        max_tokens=8, temperature=0, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def test_32_concurrent_streams_equal_the_same_prompts_alone(async_openai, idle_engine):
    assert len(PROMPTS) == NUM_REQUESTS
    together = await asyncio.gather(*(_stream_text(async_openai, p) for p in PROMPTS))
    alone = [await _stream_text(async_openai, p) for p in PROMPTS]
    assert all(finish in ("stop", "length") for _, finish in together)
    assert len({text for text, _ in together}) > NUM_REQUESTS // 2  # independent outputs
    mismatched = [(p, a, t) for p, a, t in zip(PROMPTS, alone, together, strict=True) if a != t]
    assert not mismatched
    stats = await idle_engine(30.0)
    assert stats.num_free_blocks == stats.num_blocks
