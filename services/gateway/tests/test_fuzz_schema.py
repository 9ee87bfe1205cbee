"""Schemathesis from the gateway's own /openapi.json: bodies generated within (and past)
the documented bounds never get a 5xx. Against the gateway over fakes (the fake engine
stops at the fake model's 128-token context); derandomized, bounded by max_examples."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from conveyor.gateway.app import create_app
from conveyor.gateway.settings import GatewaySettings

MAX_TOKENS = 8
"""Cap on generated max_tokens (and n) so each generation stays short."""


def cap_generation(body: object) -> None:
    """Keep a generated generation body short: max_tokens, max_completion_tokens and n
    capped when they are integers (other values are left for the gateway to refuse)."""
    if not isinstance(body, dict):
        return
    for name, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                      ("n", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap


schema = schemathesis.openapi.from_dict(create_app(GatewaySettings()).openapi())
"""The document /openapi.json serves (building the app opens no connection)."""


@schema.parametrize()
@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(threaded_gateway, case):
    cap_generation(case.body)
    case.call_and_validate(base_url=threaded_gateway.url, checks=[not_a_server_error])
