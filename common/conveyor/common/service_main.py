"""The `python -m conveyor.<service>` entry every gRPC service shares."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from conveyor.common.settings import ServiceSettings

S = TypeVar("S", bound=ServiceSettings)


def run_service(name: str, serve: Callable[[S], Awaitable[None]], settings_class: type[S]) -> int:
    """Read the settings and run `serve` until it returns (after a drain).

    Bad settings (a pydantic ValidationError, an unknown model, a value the service
    refuses) are ValueErrors whose message names the setting to change: they print
    that message and exit with status 2 instead of a traceback.
    """
    try:
        asyncio.run(serve(settings_class()))
    except ValueError as exc:
        print(f"conveyor.{name}: {exc}", file=sys.stderr)
        return 2
    return 0
