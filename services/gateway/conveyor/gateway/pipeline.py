"""The services one request flows through, connected once at startup."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from conveyor.common.grpc_client import open_channel
from conveyor.gateway.admission import Admitter
from conveyor.gateway.detok_client import DetokClient
from conveyor.gateway.engine_client import EngineClient
from conveyor.gateway.engine_picker import EnginePicker
from conveyor.gateway.metrics import GatewayMetrics
from conveyor.gateway.model_catalog import ModelCatalog
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.token_texts import TokenTexts
from conveyor.gateway.tokenizer_client import TokenizerClient


@dataclass
class Pipeline:
    """Clients of tokenizer, engines and detok, plus the gateway's own pieces.

    `draining` is set on SIGTERM: /health turns 503 and new requests are refused
    while the ones in flight finish.
    """

    settings: GatewaySettings
    tokenizer: TokenizerClient
    detok: DetokClient
    picker: EnginePicker
    catalog: ModelCatalog
    token_texts: TokenTexts
    metrics: GatewayMetrics
    admitter: Admitter = field(default_factory=Admitter)
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    draining: bool = False

    @classmethod
    def connect(cls, settings: GatewaySettings) -> Pipeline:
        """Open one channel per service (lazily connected by gRPC)."""
        tokenizer_channel = open_channel(settings.tokenizer_address)
        detok_channel = open_channel(settings.detok_address)
        engine_channels = {a: open_channel(a) for a in settings.engine_address_list}
        tokenizer = TokenizerClient(tokenizer_channel, settings.rpc_timeout_s)
        engines = [EngineClient(a, c, settings.rpc_timeout_s) for a, c in engine_channels.items()]
        return cls(
            settings=settings,
            tokenizer=tokenizer,
            detok=DetokClient(detok_channel, min(settings.rpc_timeout_s, 2.0)),
            picker=EnginePicker(engines, stats_timeout_s=min(settings.rpc_timeout_s, 3.0),
                                max_age_s=settings.engine_stats_max_age_s),
            catalog=ModelCatalog(tokenizer, settings.served_model_name),
            token_texts=TokenTexts(tokenizer),
            metrics=GatewayMetrics(),
            channels=[tokenizer_channel, detok_channel, *engine_channels.values()],
        )

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
