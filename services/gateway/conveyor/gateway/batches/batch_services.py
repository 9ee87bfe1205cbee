"""What the Files and Batches endpoints share: the stores, the task queue, and the
way each endpoint answers (its metrics, every failure as an OpenAI error body)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.common.batch_store import BatchStore
from conveyor.common.file_records import FileRecords
from conveyor.common.file_store import DirectoryFileStore, FileStore
from conveyor.gateway.batches.task_sender import TaskSender
from conveyor.gateway.errors import error_response, to_api_error
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.tenancy.api_keys import Tenant


@dataclass(slots=True)
class BatchServices:
    pipeline: Pipeline
    files: FileStore
    file_records: FileRecords
    batches: BatchStore
    tasks: TaskSender

    @classmethod
    def of(cls, request: Request) -> BatchServices:
        """The app's services, made on first use from its pipeline's settings and Redis."""
        state = request.app.state
        if getattr(state, "batch_services", None) is None:
            pipeline: Pipeline = state.pipeline
            settings = pipeline.settings
            state.batch_services = cls(
                pipeline, DirectoryFileStore(settings.files_dir),
                FileRecords(pipeline.redis, settings.redis_prefix),
                BatchStore(pipeline.redis, settings.redis_prefix),
                TaskSender(settings.batch_broker_url or settings.redis_url,
                           settings.redis_prefix))
        return state.batch_services

    async def tenant(self, request: Request) -> Tenant:
        return await self.pipeline.admitter.authenticate(request.headers)


Work = Callable[[BatchServices], Awaitable[dict | Response]]


async def serve(request: Request, endpoint: str, work: Work) -> Response:
    """Run one Files/Batches endpoint: counted in the request metrics, and any failure
    answered as an OpenAI error body."""
    services = BatchServices.of(request)
    record = services.pipeline.metrics.start(endpoint)
    try:
        result = await work(services)
    except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error body
        api_error = to_api_error(error, None, services.pipeline.settings.retry_after_s)
        record.finish(api_error.status)
        return error_response(api_error)
    record.finish(200)
    return result if isinstance(result, Response) else JSONResponse(result)
