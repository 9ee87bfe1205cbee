"""`python -m conveyor.engine` runs the engine service (settings: CONVEYOR_ENGINE_*)."""

import sys

from conveyor.common.service_main import run_service
from conveyor.engine.server import serve
from conveyor.engine.settings import EngineSettings

if __name__ == "__main__":
    sys.exit(run_service("engine", serve, EngineSettings))
