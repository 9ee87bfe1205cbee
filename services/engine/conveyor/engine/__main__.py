"""`python -m conveyor.engine` runs the engine service (settings: CONVEYOR_ENGINE_*)."""

from __future__ import annotations

import asyncio
import sys

from pydantic import ValidationError

from conveyor.common.models import ModelNotFoundError
from conveyor.engine.server import serve
from conveyor.engine.settings import EngineSettings


def main() -> int:
    try:
        asyncio.run(serve(EngineSettings()))
    except (ModelNotFoundError, ValidationError, ValueError) as exc:
        # Bad settings: the message names the setting to change.
        print(f"conveyor.engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
