"""Load-balancer probes: `/live` (the process answers) and `/ready` (send it traffic).

`/ready` turns 503 the moment SIGTERM arrives, while `/live` stays 200 and the requests
in flight finish (server.py). Neither reads Redis or the other services: a Redis outage
must not pull every gateway out of its load balancer at once. `/health` (routes.py)
is the deep check that does look at each dependency.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

router = APIRouter()


@router.get("/live")
async def live() -> JSONResponse:
    """200 while the process serves HTTP, draining included."""
    return JSONResponse({"status": "alive"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the pipeline is connected; 503 from SIGTERM on."""
    pipeline = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    if pipeline.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ready"})
