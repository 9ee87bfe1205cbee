"""`truncation: "auto"`: a conversation past the context loses its oldest turns until it fits.

As OpenAI defines it, items are dropped from the beginning of the conversation (the stored
turns of previous_response_id or `conversation`, then the input's); the instructions always
stay. Cuts fall where a turn starts (a user message), so no tool output is left without its
call; after the last user message (an agent's run of calls and outputs), before an assistant
message too. The fewest dropped that fit is found by a binary search over those starts: one
render when the whole conversation fits, about log2(turns) more when it does not. The prompt
must leave room for `max_output_tokens`, or for one token when none is asked. What is stored
and listed as the response's input stays whole; only what the model reads is cut.
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
    turns = [i for i, m in enumerate(conversation) if i and m.role == "user"]
    last_turn = turns[-1] if turns else 0
    starts = [0, *turns, *(i for i, m in enumerate(conversation)
                           if i > last_turn and m.role == "assistant")]
    render.max_tokens = render.max_tokens or 1  # some room for the answer

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
