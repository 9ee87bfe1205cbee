"""`python -m conveyor.detok` runs the detokenizer service (settings: CONVEYOR_DETOK_*)."""

from __future__ import annotations

import asyncio
import sys

from conveyor.common.models import ModelNotFoundError
from conveyor.detok.server import serve
from conveyor.detok.settings import DetokSettings


def main() -> int:
    try:
        asyncio.run(serve(DetokSettings()))
    except ModelNotFoundError as exc:
        print(f"conveyor.detok: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
