"""Entry point of `python -m conveyor.gateway.tenancy` (see cli.py)."""

import sys

from conveyor.gateway.tenancy.cli import main

sys.exit(main())
