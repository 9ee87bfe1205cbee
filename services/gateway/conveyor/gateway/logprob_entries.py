"""The OpenAI shapes of logprobs: chat's and text completions' (and vLLM's prompt logprobs,
and echo's), built from the engine's positions and the tokens' texts (detok's, one per id:
GenerationDelta.token_texts)."""

from __future__ import annotations

from conveyor.gateway.clients.engine import PositionLogprobs


class TokenIdTexts(dict):
    """The texts of vLLM's return_tokens_as_token_ids: every token shown as "token_id:{id}",
    so a token whose text is not valid UTF-8 on its own is still told apart."""

    def __missing__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


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


def prompt_logprobs_entries(prompt_ids: list[int], positions: list[PositionLogprobs],
                            texts: dict[int, str], num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map of
    token id (as text) to {logprob, rank, decoded_token}: the prompt's token first, then
    the `num_top` most likely (ranks 1..num_top), each id once."""
    entries: list[dict | None] = [None]
    for token_id, position in zip(prompt_ids[1:], positions, strict=False):
        entry = {str(token_id): _prompt_entry(position.logprob, position.rank, texts[token_id])}
        for rank, (top_id, logprob) in enumerate(position.top[:num_top], start=1):
            entry.setdefault(str(top_id), _prompt_entry(logprob, rank, texts[top_id]))
        entries.append(entry)
    return entries


def _prompt_entry(logprob: float, rank: int, text: str) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def echo_logprobs(prompt_ids: list[int], positions: list[PositionLogprobs],
                  texts: dict[int, str], num_top: int) -> dict:
    """The completions logprobs of an echoed prompt (its first token has none)."""
    tokens = [texts[token_id] for token_id in prompt_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(_finite(p.logprob) for p in positions)],
        "top_logprobs": [None, *({texts[i]: _finite(lp) for i, lp in p.top[:num_top]}
                                 for p in positions)],
        "text_offset": offsets,
    }


def _joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Completions logprobs `first` then `second` (of the text after it)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
