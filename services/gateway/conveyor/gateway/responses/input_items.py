"""GET /v1/responses/{id}/input_items: the items a stored response was generated from.

They are its stored conversation but its own answer (the earlier turns of a
previous_response_id chain, as OpenAI lists them, then this turn's input; the
instructions are not items), as Responses API items:

    user, system, developer message   message, one input_text part
    assistant message                 message, one output_text part (when it has text),
                                      then a function_call item for each of its tool calls
    tool message                      function_call_output

An item's id is the response's id and the item's place (`msg_<response>_3`), so a page
cursor (`after`) stays valid as long as the response is stored. A message sent as
several text parts is one part here: the conversation keeps its text joined.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.gateway.api.pages import list_page
from conveyor.gateway.errors import bad_request
from conveyor.gateway.responses.store import StoredResponse

MAX_LIMIT = 100
"""Items a page holds at most (OpenAI's bound; its default is 20)."""
QUERY = ("after", "limit", "order")
"""The query parameters served; `include` (the SDK sends `include[]`) has nothing to add
to an input item here, so it is refused as any other is."""


def refuse_unserved_query(query: Mapping[str, str], served: tuple[str, ...] = QUERY) -> None:
    """A 400 naming the first query parameter the endpoint (serving `served`) does not."""
    for name in query:
        if name not in served:
            takes = f"takes {', '.join(served)}" if served else "takes no query parameters"
            raise bad_request(f"{name.removesuffix('[]')} is not supported: this endpoint "
                              f"{takes}", name.removesuffix("[]"))


def input_items(stored: StoredResponse) -> list[dict]:
    """The response's input items, oldest first."""
    name = stored.response["id"].removeprefix("resp-")
    items: list[dict] = []
    inputs = stored.conversation[:-1] if stored.answered else stored.conversation
    for message in inputs:  # an answered conversation's last message is the answer
        for item in _items_of(message):
            prefix = {"message": "msg", "function_call": "fc"}.get(item["type"], "fco")
            items.append({"id": f"{prefix}_{name}_{len(items)}", **item, "status": "completed"})
    return items


def _items_of(message: dict) -> list[dict]:
    role, content = message["role"], message.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message["tool_call_id"],
                 "output": content or ""}]
    if role != "assistant":
        return [{"type": "message", "role": role,
                 "content": [{"type": "input_text", "text": content or ""}]}]
    text = [{"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": content, "annotations": []}]}]
    calls = [{"type": "function_call", "call_id": call["id"],
              "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
             for call in message.get("tool_calls") or ()]
    return (text if content else []) + calls


def items_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of `items` in `order` ("asc": oldest first), after the item `after`."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no item {after!r} in this list", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return list_page(page, start + limit < len(ordered))
