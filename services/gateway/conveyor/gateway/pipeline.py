"""The services one request flows through, connected once at startup."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from conveyor.common.engine_registry import EngineRegistry
from conveyor.common.grpc_client import Keepalive
from conveyor.gateway.clients.detok import DetokClient
from conveyor.gateway.clients.engine import EngineClients
from conveyor.gateway.clients.tokenizer import TokenizerClient
from conveyor.gateway.lora.catalog import LoraCatalog
from conveyor.gateway.models import ModelCatalog
from conveyor.gateway.observability import GatewayMetrics
from conveyor.gateway.replica_sets import replica_set
from conveyor.gateway.responses.conversation_store import ConversationStore
from conveyor.gateway.responses.store import ResponseStore
from conveyor.gateway.routing.directory import EngineDirectory, EnginePicker, StaticEngines
from conveyor.gateway.routing.router import Router
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.stored_chat.store import ChatCompletionStore
from conveyor.gateway.tenancy.admission import TenantAdmitter
from conveyor.gateway.tenancy.timeline import TimelineStore

log = logging.getLogger("conveyor.gateway")


@dataclass
class Pipeline:
    """Clients of tokenizer, engines, detok and Redis, plus the gateway's own pieces.

    `draining` is set on SIGTERM: /health turns 503 and new requests are refused
    while the ones in flight (background responses included) finish.
    """

    settings: GatewaySettings
    tokenizer: TokenizerClient
    detok: DetokClient
    engines: EngineClients
    directory: EngineDirectory
    router: Router
    admitter: TenantAdmitter
    timelines: TimelineStore
    redis: Redis
    catalog: ModelCatalog
    metrics: GatewayMetrics
    responses: ResponseStore
    conversations: ConversationStore
    chat_completions: ChatCompletionStore
    draining: bool = False

    @classmethod
    def connect(cls, settings: GatewaySettings) -> Pipeline:
        """Open one channel per service and one Redis client (all lazily connected)."""
        redis = Redis.from_url(settings.redis_url, decode_responses=True,
                               socket_timeout=settings.redis_timeout_s,
                               socket_connect_timeout=settings.redis_timeout_s,
                               retry=Retry(NoBackoff(), 1))
        metrics = GatewayMetrics()
        tokenizer = TokenizerClient(replica_set("tokenizer", settings.tokenizer_address,
                                                settings, redis, metrics), settings.rpc_timeout_s)
        engines = EngineClients(settings.rpc_timeout_s, Keepalive(
            settings.keepalive_time_s, settings.keepalive_timeout_s))
        directory = _directory(settings, redis, engines)
        adapters = LoraCatalog(redis, settings.lora_module_table, prefix=settings.redis_prefix,
                               max_age_s=settings.lora_catalog_max_age_s)
        if not settings.auth_enabled:
            log.warning("API keys are OFF (CONVEYOR_GATEWAY_AUTH_ENABLED=false): every request "
                        "is the anonymous tenant of tier %r; for local use only",
                        settings.anonymous_tier)
        return cls(
            settings=settings,
            tokenizer=tokenizer,
            detok=DetokClient(replica_set("detok", settings.detok_address, settings, redis,
                                          metrics), min(settings.rpc_timeout_s, 2.0)),
            engines=engines,
            directory=directory,
            router=Router.from_settings(redis, settings, prefix=settings.redis_prefix,
                                        engines=directory),
            admitter=TenantAdmitter.from_settings(redis, settings),
            timelines=TimelineStore(redis, prefix=settings.redis_prefix,
                                    ttl_s=settings.timeline_ttl_s),
            redis=redis,
            catalog=ModelCatalog(tokenizer, settings.served_model_name, adapters, directory),
            metrics=metrics,
            responses=ResponseStore(redis, prefix=settings.redis_prefix,
                                    ttl_s=settings.responses_ttl_s),
            conversations=ConversationStore(redis, prefix=settings.redis_prefix,
                                            ttl_s=settings.conversations_ttl_s),
            chat_completions=ChatCompletionStore(redis, prefix=settings.redis_prefix,
                                                 ttl_s=settings.responses_ttl_s),
        )

    async def close(self) -> None:
        await self.tokenizer.close()
        await self.detok.close()
        await self.engines.close()
        await self.redis.aclose()


def _directory(settings: GatewaySettings, redis: Redis,
               engines: EngineClients) -> EngineDirectory:
    """The registry, with the static engine list (if any) as its fallback."""
    static = None
    if settings.engine_address_list:
        picker = EnginePicker([engines.client(a) for a in settings.engine_address_list],
                              stats_timeout_s=min(settings.rpc_timeout_s, 3.0),
                              max_age_s=settings.engine_stats_max_age_s)
        static = StaticEngines(picker)
    return EngineDirectory(EngineRegistry(redis, prefix=settings.redis_prefix), static,
                           max_age_s=settings.engine_list_max_age_s)
