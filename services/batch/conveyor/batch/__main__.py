"""`python -m conveyor.batch` runs a worker; `... status ID` and `... run INPUT -o OUTPUT`
talk to the gateway's Batch API (see cli.py)."""

import sys

from conveyor.batch.cli import main

sys.exit(main(sys.argv[1:]))
