"""`python -m conveyor.detok` runs the detokenizer service (settings: CONVEYOR_DETOK_*)."""

import sys

from conveyor.common.service_main import run_service
from conveyor.detok.server import serve
from conveyor.detok.settings import DetokSettings

if __name__ == "__main__":
    sys.exit(run_service("detok", serve, DetokSettings))
