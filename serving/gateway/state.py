"""What a gateway process keeps between requests, in one object built at startup and handed to every handler.

`GatewayState.build()` runs in the application's lifespan (serving/gateway/asgi.py); tests build their own,
with a fake upstream where they need one, instead of resetting module globals. Clients that belong to an
event loop (the HTTP pool, the Redis connections) are opened lazily on the loop that uses them and closed by
`aclose()`.

This is where the gateway's parts are put together: each is built here and handed what it needs (background
tasks, database threads, a Redis client, callables), and none imports this module. A module whose functions
take the whole state names what it reads of it in a small protocol (`auth.KeyState`, `resolve.RouteState`,
`proxy.ProxyState`, `handlers.HandlerState`, `feed.FeedState`), which `GatewayState` fulfils.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from limits.aio.storage import RedisStorage as AsyncRedisStorage

from serving.gateway import auth, resolve
from serving.gateway.background import Background, DatabaseThreads, db_threads
from serving.gateway.batches import BatchedLookups
from serving.gateway.budgets import TokenLimits
from serving.gateway.caches import SHARED_MISSES, TENANT_MISSES, TENANT_SHARE, RefreshingCache
from serving.gateway.canary import CanaryCounters
from serving.gateway.fairslots import FairSlots
from serving.gateway.inflight import InflightCap
from serving.gateway.metering import Meter
from serving.gateway.nodehealth import NodeHealth
from serving.gateway.ratelimit import RateLimiter
from serving.gateway.residency import ColdStarts, GpuTiers
from serving.gateway.upstream import Upstream
from serving.gateway.usage import Usage
from tenants.throttles import AUTH_FAILURE_KEY_PREFIX, AsyncAuthFailures

log = logging.getLogger(__name__)

# Suspect key lookups waiting in one process at most (serving/gateway/batches.py): a few hundred bytes each.
SUSPECT_LOOKUPS_WAITING = 10_000


@dataclass(eq=False)
class GatewayState:
    """Everything one gateway process shares between requests; see the module docstring."""

    background: Background
    db: DatabaseThreads
    upstream: Upstream
    rate_limit: RateLimiter
    usage: Usage
    meter: Meter  # tokens, latency and status of every answered request, per minute (serving/gateway/metering.py)
    # The one database thread of suspect key lookups, apart from `db` (auth.py, batches.py).
    suspect_db: DatabaseThreads = field(default_factory=lambda: DatabaseThreads(1))
    keys: RefreshingCache = field(init=False)  # token SHA-256 → Caller, or the refusal to repeat
    # Key lookups of clients that look like they are guessing, in batches on a thread of their own (auth.py).
    suspect_keys: BatchedLookups = field(init=False)
    routes: RefreshingCache = field(init=False)  # (tenant id, ModelRef) → Resolution, or why there is none
    model_lists: RefreshingCache = field(init=False)  # tenant id → its servable model ids
    prewarmed: RefreshingCache = field(init=False)  # (tenant id, revision id) → when a load asked for is due
    cold: ColdStarts = field(init=False)  # loads on demand: asks, held requests, request counts (residency.py)
    gpu: GpuTiers = field(default_factory=GpuTiers)  # each node's GPU batch as modelled from this process
    inflight_cap: InflightCap = field(init=False)  # each tenant's requests in flight, shared through Redis
    node_slots: FairSlots = field(init=False)  # each node's upstream slots, shared fairly between tenants
    nodes: NodeHealth = field(init=False)  # nodes this process failed to reach lately (failover)
    tokens: TokenLimits = field(init=False)  # tokens per minute and month of tenants and keys (budgets.py)
    canary: CanaryCounters = field(init=False)  # canaries' per-arm counts, shared through Redis (canary.py)
    inflight: Counter[int] = field(default_factory=Counter)  # requests in flight per placement id
    key_lookups: dict[str, asyncio.Future] = field(default_factory=dict)  # token SHA-256 → its lookup in flight
    lookups_by_client: Counter[str] = field(default_factory=Counter)  # key lookups in flight per client address
    following: bool = False  # set by serving/gateway/feed.py while it receives live events
    _failures: tuple[Any, AsyncAuthFailures] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # Shared out per tenant (serving/gateway/caches.py): no tenant's entries or misses evict another's.
        self.keys = RefreshingCache(
            self.background,
            ttl=lambda: float(settings.MINT_GATEWAY_KEY_CACHE_S),
            share=auth.key_share,  # a tenant's keys; refusals of tokens and of genuine keys apart
            per_owner=TENANT_SHARE,
            misses_per_owner=SHARED_MISSES,
        )
        self.suspect_keys = BatchedLookups(
            self.background, self.suspect_db, auth.load_keys, max_waiting=SUSPECT_LOOKUPS_WAITING
        )
        self.routes = RefreshingCache(
            self.background,
            ttl=self.cache_ttl,
            stale=self.stale_window,
            share=resolve.tenant_share,  # a tenant's routes; its misses apart
            per_owner=TENANT_SHARE,
            misses_per_owner=TENANT_MISSES,
        )
        self.model_lists = RefreshingCache(self.background, ttl=self.cache_ttl)  # one entry per tenant
        self.prewarmed = RefreshingCache(
            self.background, ttl=self.cache_ttl, share=resolve.tenant_share, per_owner=TENANT_SHARE
        )
        self.cold = ColdStarts(self.background, self.db, self.prewarmed)
        self.inflight_cap = InflightCap(self.background, self.rate_limit.client)
        self.node_slots = FairSlots(capacity=lambda: int(settings.MINT_GATEWAY_NODE_SLOTS))
        self.nodes = NodeHealth(self._report_unreachable)
        self.tokens = TokenLimits(self.background, self.rate_limit.client, self.db)
        self.canary = CanaryCounters(self.background, self.rate_limit.client, self.db, self._canary_aborted)

    def _canary_aborted(self, tenant_id: int, adapter: str) -> None:
        """A canary this process saw breach was aborted: its routes go now, not when the live event arrives."""
        resolve.invalidate(self, tenant_id=tenant_id, adapter=adapter)

    def _report_unreachable(self, node_name: str) -> None:
        """Ask the control plane to probe a node this process could not reach (in the background)."""
        self.background.spawn(self.db.run(resolve.report_unreachable_sync, node_name), name=f"probe {node_name}")

    @classmethod
    def build(
        cls,
        *,
        upstream: Upstream | None = None,
        db: DatabaseThreads | None = None,
        suspect_db: DatabaseThreads | None = None,
    ) -> GatewayState:
        """A fresh state from the settings; tests may pass their own HTTP client and database threads."""
        background = Background()
        db = db or DatabaseThreads(db_threads())
        return cls(
            background=background,
            db=db,
            suspect_db=suspect_db or DatabaseThreads(1),
            upstream=upstream
            or Upstream(
                max_connections=settings.MINT_GATEWAY_MAX_CONNECTIONS,
                connect_timeout=settings.MINT_GATEWAY_CONNECT_TIMEOUT_S,
                read_timeout=settings.MINT_GATEWAY_READ_TIMEOUT_S,
            ),
            rate_limit=RateLimiter(background),
            usage=Usage(background, db),
            meter=Meter(background, db),
        )

    def cache_ttl(self) -> float:
        """How long a route is cached: longer while live events keep routes fresh (serving/gateway/feed.py)."""
        if self.following:
            return float(settings.MINT_GATEWAY_FOLLOWED_CACHE_S)
        return float(settings.MINT_GATEWAY_CACHE_S)

    def stale_window(self) -> float:
        """How long past its TTL a route is still served, while it is resolved again in the background.

        Only while the feed is live: events keep routes current, so the TTL only bounds the harm of a lost
        event, and the reload a late answer starts ends it. An adapter idle for longer than the TTL (most
        of a large catalog) then costs its next request no database round trip.
        """
        return float(settings.MINT_GATEWAY_FOLLOWED_STALE_S) if self.following else 0.0

    def auth_failures(self) -> AsyncAuthFailures:
        """The failed-authentication counter (tenants/throttles.py), on the rate limiter's Redis connections."""
        pool = self.rate_limit.client().connection_pool
        if self._failures is None or self._failures[0] is not pool:
            storage = AsyncRedisStorage(
                f"async+{settings.REDIS_URL}",
                implementation="redispy",
                key_prefix=AUTH_FAILURE_KEY_PREFIX,
                wrap_exceptions=True,
                connection_pool=pool,
            )
            self._failures = (pool, AsyncAuthFailures(storage))
        return self._failures[1]

    async def aclose(self) -> None:
        """Close the clients opened on the running loop (the HTTP pool, Redis); they reopen on next use."""
        await self.upstream.aclose()
        await self.rate_limit.aclose()
        self._failures = None

    async def shutdown(self) -> None:
        """At the application's shutdown: let background work finish, close every client and the threads."""
        await self.inflight_cap.aclose()  # before the drain: its sync runs for as long as slots are held
        await self.background.drain()
        self.meter.cancel_timer()
        self.canary.cancel_timer()
        try:
            await self.db.run(self.meter.flush)  # a clean shutdown loses no metered request
        except Exception:
            log.exception("gateway: the last metering flush failed; its counts are lost")
        await self.aclose()
        self.db.shutdown()
        self.suspect_db.shutdown()
