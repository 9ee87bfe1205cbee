"""Start the tokenizer: load the tokenizer and config, serve Tokenizer over gRPC until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from conveyor.common.grpc_server import (
    ServiceRegistration,
    serve_until_signalled,
    start_grpc_server,
)
from conveyor.common.log import setup_logging
from conveyor.common.models import load_config, load_tokenizer, max_model_len_of, resolve_model
from conveyor.common.registration import replica_registration
from conveyor.common.tracing import setup_tracing
from conveyor.tokenizer.chat_renderer import ChatRenderer
from conveyor.tokenizer.prompt_service import PromptService
from conveyor.tokenizer.prompt_tokenizer import PromptTokenizer
from conveyor.tokenizer.servicer import TokenizerServicer
from conveyor.tokenizer.settings import TokenizerSettings
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
log = logging.getLogger("conveyor.tokenizer")


def build_service(settings: TokenizerSettings) -> PromptService:
    """Load the model's tokenizer and config (blocking) and build the service. Prompts
    are checked against the max_model_len each request carries (the engines' own, the
    one setting of it), else the model's."""
    source = resolve_model(settings.model)
    tokenizer = load_tokenizer(source)
    config = load_config(source)
    return PromptService(
        PromptTokenizer(tokenizer, _eos_ids(config)), ChatRenderer(tokenizer),
        settings.model_name, max_model_len_of(config, None), settings.num_workers,
        settings.max_chars_per_token, settings.allow_request_chat_template,
    )


def registration(service: PromptService) -> ServiceRegistration:
    """The Tokenizer service over `service`, ready for start_grpc_server."""
    return ServiceRegistration(
        SERVICE_NAME, tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
        TokenizerServicer(service),
    )


async def serve(settings: TokenizerSettings) -> None:
    """Run the service until SIGTERM or SIGINT, then drain."""
    setup_logging("tokenizer", settings.log_level, settings.log_json)
    setup_tracing("conveyor-tokenizer")
    service = await asyncio.to_thread(build_service, settings)
    log.info("serving %s: %d tokens, the model's max_model_len %d", service.info.model,
             service.info.facts.vocab_size, service.info.max_model_len)
    server = await start_grpc_server(settings, [registration(service)])
    listing = replica_registration("tokenizer", settings, service.info.model, server.port)
    if listing is not None:
        await listing.start()
    try:
        await serve_until_signalled(server, settings,
                                    on_signal=listing.stop if listing is not None else None)
    finally:
        service.close()


def _eos_ids(config) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
