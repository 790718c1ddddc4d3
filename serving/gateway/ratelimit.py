"""Per-tenant request rate limit: a fixed one-minute window counted in Redis (INCR + EXPIRE).

Every gateway process shares the count, so the limit holds however many processes serve.
A fixed window lets a burst of up to twice the limit straddle a minute boundary; that is the
accepted price of one round trip per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref

import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

KEY_PREFIX = "mint:gw:rl"
WINDOW_S = 60
# After a failure, do not try Redis again for this long: a dead Redis must not add a
# connect timeout to every request.
_BREAKER_S = 5.0
_SOCKET_TIMEOUT_S = 0.5

# One client (and connection pool) per event loop: redis.asyncio connections belong to the loop that opened them.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = weakref.WeakKeyDictionary()
_skip_until = 0.0


def key_for(tenant_id: int, window: int) -> str:
    return f"{KEY_PREFIX}:{tenant_id}:{window}"


def _client() -> aioredis.Redis:
    url = settings.REDIS_URL
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(url)
    if client is None:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=_SOCKET_TIMEOUT_S, socket_timeout=_SOCKET_TIMEOUT_S, health_check_interval=30
        )
        per_loop[url] = client
    return client


async def hit(tenant_id: int, limit_rpm: int) -> int | None:
    """Count one request of a tenant. None if it is allowed, else the seconds until the window resets.

    Fails open: when Redis is unreachable or errors, the request is allowed and the failure
    logged. Refusing all inference because the limiter's store is down would turn a
    Redis outage into a full serving outage; the limit is a fairness guard, not a security
    boundary (keys and tenant isolation are checked against the database).
    """
    global _skip_until
    if time.monotonic() < _skip_until:
        return None
    now = time.time()
    window = int(now // WINDOW_S)
    key = key_for(tenant_id, window)
    try:
        async with _client().pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, WINDOW_S + 1)
            count, _ = await pipe.execute()
    except (TimeoutError, RedisError, OSError) as exc:
        _skip_until = time.monotonic() + _BREAKER_S
        log.warning("gateway rate limit: Redis unavailable (%s); allowing requests for %.0f s", exc, _BREAKER_S)
        return None
    if int(count) <= limit_rpm:
        return None
    return max(1, math.ceil((window + 1) * WINDOW_S - now))


async def aclose() -> None:
    """Close the running loop's Redis clients (at loop shutdown, and in tests that run one loop per call)."""
    for client in _clients.pop(asyncio.get_running_loop(), {}).values():
        await client.aclose()


def clear() -> None:
    """Forget the clients and the breaker (tests)."""
    global _skip_until
    _clients.clear()
    _skip_until = 0.0
