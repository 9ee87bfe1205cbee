"""Make sure a Redis answers at CONVEYOR_REDIS_URL's host and port (`make redis`; default
127.0.0.1:6379): devkit/local_redis.py's `ensure_redis`. Prints what it did; exits non-zero
with advice when it cannot."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # devkit: the repository's dev-only helpers
    sys.path.insert(0, str(REPO_ROOT))

from devkit.local_redis import ensure_redis  # noqa: E402


def main() -> int:
    try:
        print(ensure_redis())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
