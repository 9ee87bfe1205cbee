"""TokenTexts: one Decode call for the ids not cached, and an LRU of what it keeps."""

from __future__ import annotations

from conveyor.gateway.token_texts import TokenTexts


class _Tokenizer:
    """Records each decode_each call's ids; the text of id i is f"<{i}>"."""

    def __init__(self):
        self.calls: list[list[int]] = []

    async def decode_each(self, token_ids):
        self.calls.append(list(token_ids))
        return [f"<{i}>" for i in token_ids]


async def test_the_missing_ids_are_one_call_and_cached_ones_none():
    tokenizer = _Tokenizer()
    texts = TokenTexts(tokenizer)
    assert await texts.texts([5, 3, 5, 9]) == {5: "<5>", 3: "<3>", 9: "<9>"}
    assert await texts.texts([3, 9, 4]) == {3: "<3>", 9: "<9>", 4: "<4>"}
    assert await texts.texts([4, 5]) == {4: "<4>", 5: "<5>"}
    assert tokenizer.calls == [[5, 3, 9], [4]]


async def test_the_least_recently_used_id_goes_first():
    tokenizer = _Tokenizer()
    texts = TokenTexts(tokenizer, max_entries=3)
    await texts.texts([1, 2, 3])
    await texts.texts([1])  # 1 is used again: 2 is now the oldest
    await texts.texts([4])  # evicts 2
    await texts.texts([1, 3, 4])
    assert tokenizer.calls == [[1, 2, 3], [4]]
    await texts.texts([2])  # evicts 1 (the oldest after 1, 3, 4 were used)
    await texts.texts([3, 4])
    await texts.texts([1])
    assert tokenizer.calls == [[1, 2, 3], [4], [2], [1]]
