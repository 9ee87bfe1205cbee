"""Several generations of one request run at once, their deltas merged in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from conveyor.gateway.generation import GenerationDelta

_DONE = object()


class ChoiceStreams:
    """Runs each generation in its own task; iterate for (choice index, delta).

    Any generation's error ends the iteration with that error. `close()` (also
    called when the iteration ends) cancels every generation still running, which
    cancels their engine and detok streams.
    """

    def __init__(self, generations: list[AsyncIterator[GenerationDelta]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._run(index, generation))
            for index, generation in enumerate(generations)
        ]

    def __len__(self) -> int:
        return len(self._tasks)

    async def __aiter__(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        num_running = len(self._tasks)
        try:
            while num_running:
                index, item = await self._queue.get()
                if item is _DONE:
                    num_running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel the generations still running and wait until they have let go."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, index: int, generation: AsyncIterator[GenerationDelta]) -> None:
        try:
            async for delta in generation:
                self._queue.put_nowait((index, delta))
            self._queue.put_nowait((index, _DONE))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait((index, error))
        finally:
            await generation.aclose()


async def started(iterator: AsyncIterator) -> AsyncIterator:
    """Wait for the first item now, so that a failure before any output surfaces
    here (as an HTTP error) rather than in the middle of a response."""
    first = await anext(iterator)

    async def chained():
        yield first
        async for item in iterator:
            yield item

    return chained()
