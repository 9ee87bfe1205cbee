"""`python -m conveyor.tokenizer` runs the tokenizer service (settings: CONVEYOR_TOKENIZER_*)."""

from __future__ import annotations

import asyncio
import sys

from conveyor.common.models import ModelNotFoundError
from conveyor.tokenizer.server import serve
from conveyor.tokenizer.settings import TokenizerSettings


def main() -> int:
    try:
        asyncio.run(serve(TokenizerSettings()))
    except ModelNotFoundError as exc:
        print(f"conveyor.tokenizer: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
