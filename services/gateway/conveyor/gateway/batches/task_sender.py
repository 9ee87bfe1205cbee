"""Sending batch tasks to the workers' Celery queue, by name (no worker code here)."""

from __future__ import annotations

import asyncio

from celery import Celery

from conveyor.common.batch_queue import QUEUE, celery_config

_PUBLISH_VISIBILITY_S = 3600.0
"""Only consumers use the visibility timeout; a publisher's value does not matter."""


class TaskSender:
    """A Celery app used only to publish; it connects on the first send."""

    def __init__(self, broker_url: str, prefix: str):
        self._celery = Celery("conveyor-gateway", broker=broker_url, set_as_current=False)
        self._celery.conf.update(celery_config(prefix, _PUBLISH_VISIBILITY_S))
        self._celery.conf.broker_connection_timeout = 3
        self._celery.conf.broker_transport_options["socket_timeout"] = 3

    async def send(self, name: str, args: list) -> None:
        """Publish the task (kombu publishes synchronously: off the event loop)."""
        await asyncio.to_thread(self._celery.send_task, name, args=args, queue=QUEUE,
                                retry=False)
