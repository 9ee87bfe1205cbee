"""Conveyor's batch worker: a Celery worker that runs OpenAI Batch API jobs line by line."""
