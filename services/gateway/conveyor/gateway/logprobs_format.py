"""Logprobs in OpenAI's two shapes: chat (`content` entries) and completions
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from conveyor.gateway.engine_records import PositionLogprobs


def needed_token_ids(token_ids: list[int], logprobs: list[PositionLogprobs]) -> set[int]:
    """Every id whose text the logprobs below will show."""
    ids = set(token_ids)
    for position in logprobs:
        ids.update(token_id for token_id, _ in position.top)
    return ids


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], texts: dict[int, str],
    num_top: int,
) -> dict:
    """`{"content": [...]}` for a chat choice or chunk."""
    return {"content": [
        {**_chat_entry(texts[token_id], position.logprob),
         "top_logprobs": [_chat_entry(texts[i], lp) for i, lp in position.top[:num_top]]}
        for token_id, position in zip(token_ids, logprobs, strict=False)
    ]}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], texts: dict[int, str],
    num_top: int, text_offset: int,
) -> dict:
    """The completions shape; offsets count characters of the choice's text from text_offset."""
    tokens = [texts[token_id] for token_id in token_ids[: len(logprobs)]]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(p.logprob) for p in logprobs[: len(tokens)]],
        "top_logprobs": [
            {texts[i]: _finite(lp) for i, lp in p.top[:num_top]} for p in logprobs[: len(tokens)]
        ],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI servers send a very small number instead."""
    return max(logprob, -9999.0)
