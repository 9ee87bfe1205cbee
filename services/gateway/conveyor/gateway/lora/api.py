"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA endpoints).

Who may call them: with API keys on, an admin's key only (`create --admin`; any other
key gets 403 permission_denied, no key 401); with keys off, anyone when
CONVEYOR_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), else nobody (403).

Load `{"lora_name", "lora_path", "tenant"?}`: 400 when a field is missing or wrong
(naming it), when the name is the base model's or already in the catalog, or when the
engine cannot read the adapter (the engine's message); one live engine serving adapters
(picked as a request would be) loads it first, so a bad adapter never enters the
catalog. With `tenant`, only that tenant sees and uses it; without, every tenant.
Answers the adapter's model card with its rank and target modules.

Unload `{"lora_name"}`: 404 when the catalog has no such adapter; otherwise it leaves
the catalog at once, and every live engine serving adapters is asked to drop it
(requests running with it finish first; an engine that does not hold it, or cannot be
reached, is skipped). Answers `{"id", "object": "model", "deleted": true}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import AfterValidator, Field
from starlette.responses import Response

from conveyor.gateway.api.fields import RequestBody
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.errors import APIError, bad_request
from conveyor.gateway.lora.catalog import AdapterRecord, check_adapter_name
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.routes import model_card, serve_simple
from conveyor.gateway.tenancy.api_keys import check_tenant_id
from conveyor.gateway.tenancy.errors import PermissionDenied

log = logging.getLogger("conveyor.gateway.lora")

router = APIRouter()

AdapterName = Annotated[str, AfterValidator(check_adapter_name)]


class LoadLoraAdapterRequest(RequestBody):
    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1)]
    tenant: Annotated[str, AfterValidator(check_tenant_id)] | None = None
    """The one tenant that may see and use it (absent: every tenant)."""


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: AdapterName


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        await _require_admin(pipeline, request.headers)
        return await _load(pipeline, AdapterRecord(body.lora_name, body.lora_path, body.tenant,
                                                   time.time()))

    return await serve_simple(request, "load_lora_adapter", work)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        await _require_admin(pipeline, request.headers)
        await _unload(pipeline, body.lora_name)
        return {"id": body.lora_name, "object": "model", "deleted": True}

    return await serve_simple(request, "unload_lora_adapter", work)


async def _require_admin(pipeline: Pipeline, headers: Mapping[str, str]) -> None:
    """Pass an admin's key, or anyone while keys are off and the setting allows it."""
    if not pipeline.admitter.auth_enabled:
        if not pipeline.settings.allow_runtime_lora_updating:
            raise PermissionDenied("Loading and unloading LoRA adapters is off while API keys "
                                   "are off; set CONVEYOR_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING="
                                   "true to allow it.")
        return
    tenant = await pipeline.admitter.authenticate(headers)
    if not tenant.is_admin:
        raise PermissionDenied("Loading and unloading LoRA adapters takes an admin's API key "
                               "(python -m conveyor.gateway.tenancy create --admin).")


async def _load(pipeline: Pipeline, record: AdapterRecord) -> dict:
    """Have one engine read the adapter, then add it to the catalog."""
    base = await pipeline.catalog.model()
    if record.name in (base.name, base.backend_name):
        raise bad_request(f"`{record.name}` is the base model's name.", "lora_name")
    if await pipeline.catalog.adapters.get(record.name) is not None:
        raise _already_loaded(record.name)
    engine = await pipeline.router.pick(None, (), model=base.backend_name, lora=record.name)
    async with pipeline.engines.lease(engine.address) as client:
        facts = await client.load_lora_adapter(record.adapter)
    if not await pipeline.catalog.adapters.add(record):
        raise _already_loaded(record.name)
    log.info("LoRA adapter %s loaded from %s (rank %d) for %s", record.name, record.path,
             facts.rank, record.tenant_id or "every tenant")
    return {**model_card(base.with_adapter(record)), "rank": facts.rank,
            "target_modules": list(facts.target_modules)}


async def _unload(pipeline: Pipeline, name: str) -> None:
    """Take the adapter out of the catalog, then out of every engine serving adapters."""
    if not await pipeline.catalog.adapters.remove(name):
        raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", "invalid_request_error",
                       "lora_name", "lora_adapter_not_found")
    base = await pipeline.catalog.model()
    engines = [e for e in await pipeline.router.live_engines(base.backend_name)
               if e.serves_adapters]
    await asyncio.gather(*(_drop(pipeline, e.address, name) for e in engines))
    log.info("LoRA adapter %s unloaded (asked %d engines to drop it)", name, len(engines))


async def _drop(pipeline: Pipeline, address: str, name: str) -> None:
    try:
        async with pipeline.engines.lease(address) as client:
            await client.unload_lora_adapter(name)
    except UpstreamError as error:
        if error.code != "NOT_FOUND":
            log.warning("engine %s could not drop LoRA adapter %s: %s", address, name, error)


def _already_loaded(name: str) -> APIError:
    return bad_request(f"The LoRA adapter `{name}` has already been loaded.", "lora_name",
                       "lora_adapter_exists")
