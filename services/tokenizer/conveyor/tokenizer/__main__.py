"""`python -m conveyor.tokenizer` runs the tokenizer service (settings: CONVEYOR_TOKENIZER_*)."""

import sys

from conveyor.common.service_main import run_service
from conveyor.tokenizer.server import serve
from conveyor.tokenizer.settings import TokenizerSettings

if __name__ == "__main__":
    sys.exit(run_service("tokenizer", serve, TokenizerSettings))
