"""Start the detokenizer: load the tokenizer, serve Detokenizer over gRPC until SIGTERM
(its calls open the engines' streams, one channel per engine)."""

from __future__ import annotations

import asyncio
import logging

from conveyor.common.grpc_client import Channels
from conveyor.common.grpc_server import (
    ServiceRegistration,
    serve_until_signalled,
    start_grpc_server,
)
from conveyor.common.log import setup_logging
from conveyor.common.models import load_tokenizer, resolve_model
from conveyor.common.registration import replica_registration
from conveyor.common.tracing import setup_tracing
from conveyor.detok.servicer import DetokenizerServicer
from conveyor.detok.settings import DetokSettings
from conveyor.v1 import detok_pb2, detok_pb2_grpc

SERVICE_NAME = detok_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name
log = logging.getLogger("conveyor.detok")


def registration(tokenizer, engines: Channels) -> ServiceRegistration:
    """The Detokenizer service over `tokenizer`, its calls' engine streams opened on
    `engines`, ready for start_grpc_server."""
    return ServiceRegistration(
        SERVICE_NAME, detok_pb2_grpc.add_DetokenizerServicer_to_server,
        DetokenizerServicer(tokenizer, engines),
    )


async def serve(settings: DetokSettings) -> None:
    """Run the service until SIGTERM or SIGINT, then drain."""
    setup_logging("detok", settings.log_level, settings.log_json)
    setup_tracing("conveyor-detok")
    source = resolve_model(settings.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, source)
    log.info("tokenizer of %s loaded (%d tokens)", source.name, len(tokenizer))
    engines = Channels()
    service = await start_grpc_server(settings, [registration(tokenizer, engines)])
    listing = replica_registration("detok", settings, settings.model_name, service.port)
    if listing is not None:
        await listing.start()
    await serve_until_signalled(service, settings, on_drained=engines.close,
                                on_signal=listing.stop if listing is not None else None)
