"""`truncation: "auto"`: a conversation past the context loses its oldest turns until it fits.

As OpenAI defines it, items are dropped from the beginning of the conversation (the stored
turns of previous_response_id, then the input's); the instructions always stay. Cuts fall only
where a turn starts (a user message), so no tool output is left without its call. The fewest
dropped that fit is found by a binary search over those starts: one render when the whole
conversation fits, about log2(turns) more when it does not. What is stored and listed as the
response's input stays whole; only what the model reads is cut.
"""

from __future__ import annotations

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED
from conveyor.gateway.api.mapping import chat_turns
from conveyor.gateway.api.tools import ChatMessage
from conveyor.gateway.clients.tokenizer import PromptTokens, RenderInput, TokenizerClient
from conveyor.gateway.clients.upstream import UpstreamError


async def render_fitting(tokenizer: TokenizerClient, render: RenderInput,
                         instructions: list[ChatMessage],
                         conversation: list[ChatMessage]) -> PromptTokens:
    """`instructions` and the longest tail of `conversation` that starts a turn and fits
    (with `render.max_tokens`); the whole conversation's error when no tail fits."""
    starts = [0, *(i for i, m in enumerate(conversation) if i and m.role == "user")]

    async def rendered_from(start: int) -> PromptTokens:
        render.messages = chat_turns([*instructions, *conversation[start:]])
        return await tokenizer.render(render)

    try:
        return await rendered_from(0)
    except UpstreamError as error:
        if error.reason != CONTEXT_LENGTH_EXCEEDED:
            raise
        too_long = error
    fitting, low, high = None, 1, len(starts) - 1
    while low <= high:  # the first start that fits: every later one fits too
        middle = (low + high) // 2
        try:
            fitting, high = await rendered_from(starts[middle]), middle - 1
        except UpstreamError as error:
            if error.reason != CONTEXT_LENGTH_EXCEEDED:
                raise
            low = middle + 1
    if fitting is None:
        raise too_long
    return fitting
