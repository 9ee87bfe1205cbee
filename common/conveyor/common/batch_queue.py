"""The Celery contract between gateways (who enqueue) and batch workers (who run).

No Celery import here: gateways send tasks by name (`send_task`) with the same
broker configuration the workers use, so both agree on the queue and keys.
"""

from __future__ import annotations

START_TASK = "conveyor.batch.start"
"""start(batch_id): validate the input file and enqueue the batch's chunks."""
CHUNK_TASK = "conveyor.batch.chunk"
"""chunk(batch_id, first_line, end_line, byte_offset): run lines [first, end)."""
QUEUE = "conveyor-batch"


def celery_config(prefix: str, visibility_timeout_s: float) -> dict:
    """Celery settings for the Redis broker: late acknowledgement, a task of a worker
    that died goes back to the queue, one task reserved at a time, and a message
    left unacknowledged (its worker killed outright) delivered again
    `visibility_timeout_s` after it was taken."""
    return {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": QUEUE,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout_s,
            "global_keyprefix": f"{prefix}:celery:",
            "unacked_restore_interval": max(1, min(10, int(visibility_timeout_s / 10))),
            "unacked_restore_throttle": 1,
            # A worker killed while it held the restore lock must not stall restores long.
            "unacked_mutex_expire": int(min(300, max(5, visibility_timeout_s / 2))),
        },
    }
