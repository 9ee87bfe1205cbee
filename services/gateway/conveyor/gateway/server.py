"""Run the gateway under uvicorn: print the bound port, drain on SIGTERM, readiness first.

On the first SIGTERM (or SIGINT) the gateway keeps listening: `/ready` answers 503 at
once while `/live` stays 200, new API requests get 503 with Retry-After, and the
requests in flight go on. Once none is left, or `drain_timeout_s` after the signal,
uvicorn's own shutdown runs (it cancels what is still running) and the process exits
with status 0. A second signal skips the wait.
"""

from __future__ import annotations

import logging
import socket
import time

import uvicorn
from fastapi import FastAPI

from conveyor.common.log import setup_logging
from conveyor.common.tracing import setup_tracing
from conveyor.gateway.app import create_app
from conveyor.gateway.settings import GatewaySettings

log = logging.getLogger("conveyor.gateway")

MIN_SHUTDOWN_S = 0.5
"""What uvicorn's shutdown gets at least, after the drain, to close connections."""


class GatewayServer(uvicorn.Server):
    """uvicorn's server that announces its port once bound (the line launchers and
    tests wait for) and drains before it stops listening (see the module doc)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float):
        super().__init__(config)
        self._app = app
        self._drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"CONVEYOR_LISTENING port={port}", flush=True)
            log.info("gateway serving on http://%s:%d", self.config.host, port)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_deadline is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        pipeline = getattr(self._app.state, "pipeline", None)
        if pipeline is not None:
            pipeline.draining = True
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        log.info("draining: not ready; up to %.1fs for requests in flight",
                 self._drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit and self._drained():
            self.config.timeout_graceful_shutdown = max(
                MIN_SHUTDOWN_S, self._drain_deadline - time.monotonic())
            self.should_exit = True
        return await super().on_tick(counter)

    def _drained(self) -> bool:
        """Nothing in flight any more (background responses included), or the drain
        timeout is up."""
        background = getattr(self._app.state, "background", None)
        idle = not self.server_state.tasks and not (background and background.running)
        return idle or time.monotonic() >= self._drain_deadline


def main() -> None:
    settings = GatewaySettings()
    setup_logging("gateway", settings.log_level, settings.log_json)
    setup_tracing("conveyor-gateway")
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s, lifespan="on",
    )
    GatewayServer(config, app, settings.drain_timeout_s).run()
