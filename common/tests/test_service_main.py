"""`python -m conveyor.<service>`: the service runs on uvloop; bad settings exit 2."""

import asyncio

import uvloop

from conveyor.common.service_main import run_service
from conveyor.common.settings import ServiceSettings


def test_the_service_runs_on_uvloop():
    loops = []

    async def serve(settings: ServiceSettings) -> None:
        loops.append(asyncio.get_running_loop())

    assert run_service("probe", serve, ServiceSettings) == 0
    assert len(loops) == 1 and isinstance(loops[0], uvloop.Loop)


def test_a_refused_setting_exits_2_with_its_message(capsys):
    async def serve(settings: ServiceSettings) -> None:
        raise ValueError("CONVEYOR_PROBE_X: not a size")

    assert run_service("probe", serve, ServiceSettings) == 2
    assert "conveyor.probe: CONVEYOR_PROBE_X: not a size" in capsys.readouterr().err
