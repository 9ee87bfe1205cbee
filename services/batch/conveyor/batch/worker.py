"""`python -m conveyor.batch`: one Celery worker on the batch queue."""

from __future__ import annotations

import logging
import socket

from celery.signals import worker_ready

from conveyor.batch.celery_app import create_celery
from conveyor.batch.settings import BatchSettings
from conveyor.common.batch_queue import QUEUE


def run_worker(settings: BatchSettings) -> int:
    """Run until SIGTERM (warm shutdown: the task under way finishes first)."""
    app = create_celery(settings)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per batch line
    worker_ready.connect(_announce, weak=False)
    app.worker_main(["worker", "--pool=solo", "--queues", QUEUE,
                     f"--loglevel={settings.log_level}", "--without-gossip", "--without-mingle",
                     "--without-heartbeat", "--hostname", f"batch@{socket.gethostname()}"])
    return 0


def _announce(**_) -> None:
    """The line launchers and tests wait for (a worker listens on no port)."""
    print("CONVEYOR_LISTENING port=0", flush=True)
