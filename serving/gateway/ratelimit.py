"""Per-tenant request rate limit: a fixed one-minute window, counted here and shared through Redis.

A request never waits on Redis. Each gateway process counts its own requests in memory
and decides on `known + pending`: the window's total as Redis last reported it plus this
process's requests not yet sent there. A background task adds the pending counts to Redis
(INCRBY + EXPIRE, one pipeline for every tenant at once) and reads back the totals, which
include every other process's requests. So the limit holds exactly within one process and,
across processes, as of each process's last flush (a few milliseconds behind under load). A
process learns that the others took the window to the limit only from its own next flush, so
it admits that request: with P processes, up to P - 1 requests past the limit in a window
(more for a burst that reaches several processes within one flush; tests/e2e/test_web_processes.py).
A fixed window lets a burst of up to twice the limit straddle a minute boundary; that is
the accepted price of counting this cheaply.

When Redis is unreachable, each process keeps limiting on its own count and logs the failure.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from django.conf import settings

from mint_site.redis_breaker import REDIS_DOWN, RedisBreaker

if TYPE_CHECKING:
    from serving.gateway.background import Background

KEY_PREFIX = "mint:gw:rl"
WINDOW_S = 60
_SOCKET_TIMEOUT_S = 0.5


def key_for(tenant_id: int, window: int) -> str:
    return f"{KEY_PREFIX}:{tenant_id}:{window}"


@dataclass
class _Count:
    known: int = 0  # the window's total across processes, as of the last flush
    pending: int = 0  # this process's requests not yet added in Redis


class RateLimiter:
    """The process's counts per (tenant, window), its Redis client, and the breaker for a dead Redis."""

    def __init__(self, background: Background) -> None:
        self._background = background
        # (tenant id, window) → count. Only the current and the previous window are kept.
        self._counts: dict[tuple[int, int], _Count] = {}
        self._flusher: asyncio.Task | None = None
        self._breaker = RedisBreaker("gateway rate limit", meanwhile="local counts")
        self._clients: dict[str, aioredis.Redis] = {}  # by URL (tests point the gateway at another Redis)

    def client(self) -> aioredis.Redis:
        """The Redis client of the running loop (redis.asyncio connections belong to the loop that opened them)."""
        url = settings.REDIS_URL
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = aioredis.Redis.from_url(
                url,
                socket_connect_timeout=_SOCKET_TIMEOUT_S,
                socket_timeout=_SOCKET_TIMEOUT_S,
                health_check_interval=30,
            )
        return client

    def hit(self, tenant_id: int, limit_rpm: int) -> int | None:
        """Count one request of a tenant. None if it is allowed, else the seconds until the window resets.

        Refused requests are not counted. Schedules a flush to Redis on the running loop.
        """
        now = time.time()
        window = int(now // WINDOW_S)
        count = self._counts.get((tenant_id, window))
        if count is None:
            for stale in [k for k in self._counts if k[1] < window - 1]:
                del self._counts[stale]
            count = self._counts[(tenant_id, window)] = _Count()
        if count.known + count.pending >= limit_rpm:
            return max(1, math.ceil((window + 1) * WINDOW_S - now))
        count.pending += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = self._background.spawn(self._flush(), name="rate limit flush")
        return None

    async def _flush(self) -> None:
        """Add every pending count to Redis and learn the totals; repeats while requests keep coming."""
        while batch := [(key, count, count.pending) for key, count in self._counts.items() if count.pending]:
            if self._breaker.open:
                return
            try:
                async with self.client().pipeline(transaction=False) as pipe:
                    for (tenant_id, window), _, pending in batch:
                        pipe.incrby(key_for(tenant_id, window), pending)
                        pipe.expire(key_for(tenant_id, window), WINDOW_S + 1)
                    results = await pipe.execute()
            except REDIS_DOWN as exc:
                self._breaker.trip(exc)
                return
            for (_, count, pending), total in zip(batch, results[::2], strict=True):
                count.pending -= pending
                count.known = int(total)  # everyone's requests, this process's flushed ones included

    async def aclose(self) -> None:
        """Close the Redis clients (at shutdown, and in tests that run one loop per call)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
