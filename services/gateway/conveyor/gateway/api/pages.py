"""The list endpoints' cursor pages (files, batches, a response's input items, a
conversation's items, stored chat completions), and the refusal of a query parameter an
endpoint does not serve."""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.gateway.errors import bad_request

MAX_LIMIT = 100
"""Items a page holds at most (OpenAI's bound; its default is 20)."""
PAGE_QUERY = ("after", "limit", "order")
"""A page's query parameters; others, such as `include` (the SDK sends `include[]`), are
refused where an endpoint has nothing to add with them."""


def list_page(data: list[dict], has_more: bool) -> dict:
    """A list response as OpenAI's cursor pages have it."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def refuse_unserved_query(query: Mapping[str, str], served: tuple[str, ...] = PAGE_QUERY) -> None:
    """A 400 naming the first query parameter the endpoint (serving `served`) does not."""
    for name in query:
        if name not in served:
            takes = f"takes {', '.join(served)}" if served else "takes no query parameters"
            raise bad_request(f"{name.removesuffix('[]')} is not supported: this endpoint "
                              f"{takes}", name.removesuffix("[]"))


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
