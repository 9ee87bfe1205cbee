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

from conveyor.gateway.responses.store import StoredResponse


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
