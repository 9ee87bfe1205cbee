"""Race a request's work against its client's disconnect and its deadline.

The disconnect is an `http.disconnect` message from the ASGI server, awaited by
a watcher task: nothing polls. Whichever finishes first wins; the work loses by
being cancelled, which cancels its gRPC streams (see generation.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


class RequestTimedOut(Exception):
    """The request ran past its deadline."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports the client gone (the body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_client(work: Awaitable[T], receive: Receive, deadline: float) -> T:
    """work's result, unless the client disconnects first (ClientDisconnected) or
    the loop's clock passes `deadline` first (RequestTimedOut); the loser is cancelled."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    timeout_s = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait(
            {work_task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        await _cancel_and_wait(work_task, watcher)
    if work_task in done:
        return work_task.result()
    if watcher in done:
        raise ClientDisconnected()
    raise RequestTimedOut()


async def _cancel_and_wait(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
