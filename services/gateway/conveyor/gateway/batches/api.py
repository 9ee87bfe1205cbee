"""The Files and Batches endpoints, as one router for the app to include."""

from fastapi import APIRouter

from conveyor.gateway.batches import batches_api, files_api

router = APIRouter()
router.include_router(files_api.router)
router.include_router(batches_api.router)
