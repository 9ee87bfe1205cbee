"""The list endpoints' cursor pages (files, batches, a response's input items)."""


def list_page(data: list[dict], has_more: bool) -> dict:
    """A list response as OpenAI's cursor pages have it."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
