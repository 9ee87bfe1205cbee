"""Who is asking and whether they may (the auth/admit seam).

Today every caller is anonymous and every request is admitted; API keys,
tenants and Redis-backed quotas come later and slot in here without changing
the request handlers.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers

from conveyor.gateway.usage_totals import UsageTotals


@dataclass(slots=True)
class Caller:
    """The authenticated caller (anonymous for now)."""

    tenant: str = "anonymous"
    cache_salt: str = ""


@dataclass(slots=True)
class Admission:
    """A request that was let in; `settle` is called once it is done."""

    caller: Caller
    num_prompt_tokens: int
    max_tokens: int

    async def settle(self, usage: UsageTotals | None) -> None:
        """Release what was reserved but not used (nothing is reserved yet)."""


class Admitter:
    """Authenticates callers and admits their requests."""

    async def authenticate(self, headers: Headers) -> Caller:
        return Caller()

    async def admit(self, caller: Caller, num_prompt_tokens: int, max_tokens: int) -> Admission:
        return Admission(caller, num_prompt_tokens, max_tokens)
