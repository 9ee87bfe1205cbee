"""Turn merged choice deltas into an OpenAI response: SSE chunk payloads or one body."""

from __future__ import annotations

from collections.abc import AsyncIterator

from conveyor.gateway.generation import GenerationDelta
from conveyor.gateway.logprobs_format import needed_token_ids
from conveyor.gateway.response_formats import ChoiceResult, ResponseFormat
from conveyor.gateway.token_texts import TokenTexts
from conveyor.gateway.usage_totals import UsageTotals

Deltas = AsyncIterator[tuple[int, GenerationDelta]]


async def stream_payloads(
    deltas: Deltas, fmt: ResponseFormat, num_choices: int, usage: UsageTotals,
    token_texts: TokenTexts, include_usage: bool,
) -> AsyncIterator[dict]:
    """The chunk payloads of a streaming response, in order; the usage chunk last."""
    for chunk in fmt.opening_chunks(num_choices):
        yield chunk
    async for index, delta in deltas:
        texts = await _texts_of(fmt, token_texts, delta.token_ids, delta.logprobs)
        chunk = fmt.chunk(index, delta, texts)
        usage.observe(index, delta)
        if chunk is not None:
            yield chunk
    if include_usage:
        yield fmt.usage_chunk(usage)


async def collect_response(
    deltas: Deltas, fmt: ResponseFormat, num_choices: int, usage: UsageTotals,
    token_texts: TokenTexts,
) -> dict:
    """The body of a non-streaming response once every choice finished."""
    results = [ChoiceResult() for _ in range(num_choices)]
    async for index, delta in deltas:
        results[index].add(delta)
        usage.observe(index, delta)
    token_ids = [i for r in results for i in r.token_ids]
    logprobs = [p for r in results for p in r.logprobs]
    texts = await _texts_of(fmt, token_texts, token_ids, logprobs)
    return fmt.response(results, texts, usage)


async def _texts_of(fmt: ResponseFormat, token_texts: TokenTexts, token_ids, logprobs) -> dict:
    if not fmt.wants_logprobs or not logprobs:
        return {}
    return await token_texts.texts(needed_token_ids(token_ids, logprobs))
