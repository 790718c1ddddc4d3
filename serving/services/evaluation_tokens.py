"""An evaluation's tokens against its tenant's own token limits: the monthly budget and tokens per minute.

An evaluation runs the tenant's own prompts on the shared nodes (serving/services/evaluation.py), so its tokens
are the tenant's like any request's: metered as `evaluation` (billed, serving.models.BILLED_KINDS), added to the
same Redis counters the gateway keeps (serving/gateway/budgets.py; their layout is serving/services/budgets.py),
and an evaluation waits (tokens per minute) or ends (a spent budget) when they are used up. The gateway's
processes read the counters again within a second, so the tenant's inference is refused for the same tokens.

Every call is one or two Redis round trips from the node agent, never on a request's path. When Redis cannot
be reached the counters are left alone and the evaluation goes on (the gateway's limits hold on what it knew).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import cache

import redis
from django.conf import settings

from serving.services.budgets import WINDOW_S, Period, month_key, usage_month_tokens, window_key
from tenants.models import Tenant

log = logging.getLogger(__name__)

_SOCKET_TIMEOUT_S = 0.5
# Adds to a month's counter only when it exists: an absent one is rebuilt from the database (the gateway's
# rule), which has these tokens once they are metered.
_ADD_IF_PRESENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return -1
"""


@dataclass(frozen=True)
class TokenLimitHit:
    """A limit of the tenant's that the evaluation's tokens have used up: why, and when it frees (epoch seconds)."""

    code: str  # tokens_per_minute_exceeded (wait) or budget_exhausted (give up)
    message: str
    frees_at: float


@cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S)


def evaluation_token_limit(*, tenant: Tenant, now: float | None = None) -> TokenLimitHit | None:
    """The tenant's limit its tokens have reached now, if any (its month as Redis counts it, or as the database
    has it while Redis has no counter; its current minute as Redis counts it)."""
    now = time.time() if now is None else now
    period = Period.at(now)
    client = _client(settings.REDIS_URL)
    try:
        if tenant.monthly_token_budget:
            counted = client.get(month_key(tenant.id, None, period.month))
            used = (
                int(counted)
                if counted is not None
                else usage_month_tokens(tenant_id=tenant.id, start=period.month_start, end=period.month_end)
            )
            if used >= tenant.monthly_token_budget:
                return TokenLimitHit(
                    "budget_exhausted",
                    f"Tenant {tenant.slug} has used its monthly budget of {tenant.monthly_token_budget:,} tokens "
                    f"({used:,} in {period.month}, UTC); evaluations count against it.",
                    period.month_end.timestamp(),
                )
        if tenant.max_tokens_per_minute:
            used = int(client.get(window_key(tenant.id, None, period.minute)) or 0)
            if used >= tenant.max_tokens_per_minute:
                return TokenLimitHit(
                    "tokens_per_minute_exceeded",
                    f"Tenant {tenant.slug} has used its limit of {tenant.max_tokens_per_minute:,} tokens per minute.",
                    float(period.minute_end),
                )
    except (redis.RedisError, OSError) as exc:
        log.warning("evaluation tokens: Redis unavailable (%s); the tenant's limits not checked", exc)
    return None


def evaluation_tokens_spend(*, tenant: Tenant, tokens: int, now: float | None = None) -> None:
    """Add an evaluation's tokens to the tenant's counters: its month (when the counter exists) and, when it has a
    limit per minute, the current minute (as the gateway does: serving/gateway/budgets.py)."""
    if tokens <= 0:
        return
    now = time.time() if now is None else now
    period = Period.at(now)
    client = _client(settings.REDIS_URL)
    try:
        client.eval(_ADD_IF_PRESENT, 1, month_key(tenant.id, None, period.month), tokens)
        if tenant.max_tokens_per_minute:
            window = window_key(tenant.id, None, period.minute)
            with client.pipeline() as pipe:
                pipe.incrby(window, tokens)
                pipe.expire(window, 2 * WINDOW_S, nx=True)
                pipe.execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("evaluation tokens: Redis unavailable (%s); %d tokens of %s not counted", exc, tokens, tenant)


def seconds_until(hit: TokenLimitHit, now: float | None = None) -> float:
    return max(1.0, math.ceil(hit.frees_at - (time.time() if now is None else now)))
