"""Run the gateway under uvicorn: print the bound port, drain on SIGTERM."""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

from conveyor.common.log import setup_logging
from conveyor.common.tracing import setup_tracing
from conveyor.gateway.app import create_app
from conveyor.gateway.settings import GatewaySettings

log = logging.getLogger("conveyor.gateway")


class GatewayServer(uvicorn.Server):
    """uvicorn's server that announces its port once bound (the line launchers and
    tests wait for) and marks the pipeline draining as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"CONVEYOR_LISTENING port={port}", flush=True)
            log.info("gateway serving on http://%s:%d", self.config.host, port)

    def handle_exit(self, sig: int, frame) -> None:
        pipeline = getattr(self._app.state, "pipeline", None)
        if pipeline is not None:
            pipeline.draining = True
        super().handle_exit(sig, frame)


def main() -> None:
    settings = GatewaySettings()
    setup_logging("gateway", settings.log_level, settings.log_json)
    setup_tracing("conveyor-gateway")
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s, lifespan="on",
    )
    GatewayServer(config, app).run()
