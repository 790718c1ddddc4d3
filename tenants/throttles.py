"""Request throttles of the REST API, and the count of failed key authentications per client address.

Both are kept in Redis, so every process of the site (web servers, gateways) shares them:

- `ApiRateThrottle`: DRF throttling per API key (by key id) or per signed-in person (by user id, in one
  tenant), reads (GET, HEAD, OPTIONS) and writes counted apart, at the rate of the caller's tenant plan
  (`Tenant.api_read_rpm`, `Tenant.api_write_rpm`; staff endpoints without a tenant use those fields'
  defaults), and every write also against the tenant's own `api_tenant_write_rpm`, all its keys and people
  together. It is DRF's `SimpleRateThrottle` on the Django cache (a sliding log of the last minute's
  requests); `api_write_wait` counts one write outside DRF (the ASGI upload gate) in the same entries.
- Failed key authentications (a malformed token, an unknown prefix, a wrong secret), per client address and,
  for a wrong secret, per key (`failure_buckets`), over a fixed one-minute window, counted with the `limits`
  library: one Lua INCR+EXPIRE per failure, one GET per check. Django (redis-py) and the gateway
  (redis.asyncio, never blocking its event loop) use the same keys. They limit guesses, never a valid key:
  the key a request carries is checked first, and only a refused one meets the counts, so a guess past
  MINT_AUTH_FAILURES_PER_MIN from an address (or against one key's prefix) is answered 429 instead of 401
  while a valid key from the same address (a NAT, a load balancer) goes on working. Answers about genuine
  keys (revoked, expired, a creator without access, a suspended tenant) are not failures: the secret matched,
  so nothing was being guessed, and a pipeline retrying with a revoked key must not count against its
  colleagues behind the same address. The address is the ASGI server's peer, which it takes from
  `X-Forwarded-For` only for the proxies in MINT_FORWARDED_ALLOW_IPS (devtools/launcher.py).

When Redis cannot be reached, both let requests through and log it (for a few seconds without trying
again): a throttle must not take the API down with it.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from functools import cache
from typing import Any

from django.conf import settings
from limits import RateLimitItemPerMinute
from limits.aio.storage import Storage as AsyncStorage
from limits.aio.strategies import FixedWindowRateLimiter as AsyncFixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import RedisStorage
from limits.strategies import FixedWindowRateLimiter
from rest_framework import exceptions
from rest_framework.throttling import SimpleRateThrottle

from mint_site.redis_breaker import REDIS_DOWN, RedisBreaker
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)

# Redis keys of the failure counts: `<prefix>:LIMITER/<address>/<limit>/1/minute` (the `limits` layout).
AUTH_FAILURE_KEY_PREFIX = "mint:authfail"
# Django cache keys of the API throttle (under the cache's own `mint:<version>:` prefix).
API_THROTTLE_KEY_BASE = "throttle_api_"
WINDOW_S = 60
# Within a minute's rate, at most a sixth of it (and at least BURST_MIN) in any BURST_WINDOW_S.
BURST_WINDOW_S = 10
BURST_MIN = 5


def burst_of(rate_per_minute: int) -> int:
    """Requests allowed in any BURST_WINDOW_S at a rate of `rate_per_minute`."""
    return max(BURST_MIN, math.ceil(rate_per_minute * BURST_WINDOW_S / WINDOW_S))


def burst_note(rate_per_minute: int) -> str:
    """The note " (at most N in any 10 s)" where that binds before the minute's rate does, else nothing."""
    burst = burst_of(rate_per_minute)
    return f" (at most {burst} in any {BURST_WINDOW_S} s)" if burst < rate_per_minute else ""


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SOCKET_TIMEOUT_S = 0.5
_STORAGE_ERRORS = (StorageError, *REDIS_DOWN)


# ---------------------------------------------------------------------------------------------
# Failed authentications per client address


def client_bucket(address: str | None) -> str | None:
    """What failures are counted per: an IPv4 address, or the /64 of an IPv6 one (one host's usual share).

    None (no address: a test client, a Unix socket without a proxy) is not counted.
    """
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:100]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def credential_bucket(prefix: str) -> str:
    """What failures against one existing key (its prefix with a wrong secret) are counted per."""
    return f"key:{prefix}"


def failure_buckets(*, client: str | None, wrong_secret_of: str | None) -> list[str]:
    """What one failed authentication counts against: the client's address (if known) and, for a wrong secret
    of an existing key, that key. A token that names no key counts against its address only: a random prefix
    is nothing to count."""
    buckets = [bucket] if (bucket := client_bucket(client)) is not None else []
    if wrong_secret_of:
        buckets.append(credential_bucket(wrong_secret_of))
    return buckets


def failure_limit() -> RateLimitItemPerMinute:
    return RateLimitItemPerMinute(settings.MINT_AUTH_FAILURES_PER_MIN)


class AuthFailures:
    """The failed-authentication counts, from synchronous code (DRF, the upload gate); one per process."""

    def __init__(self, redis_url: str) -> None:
        self._storage = RedisStorage(
            redis_url,
            key_prefix=AUTH_FAILURE_KEY_PREFIX,
            wrap_exceptions=True,
            socket_timeout=_SOCKET_TIMEOUT_S,
            socket_connect_timeout=_SOCKET_TIMEOUT_S,
        )
        self._limiter = FixedWindowRateLimiter(self._storage)
        self._breaker = RedisBreaker("auth failure counts", meanwhile="not counting")

    def refused(self, buckets: list[str]) -> float | None:
        """Count one failure against every bucket: None while all are within the limit (answer 401), else the
        seconds until the last one past it may try again (answer 429). Each count is one atomic INCR, so
        failures answered at the same moment cannot all slip under the limit."""
        if self._breaker.open:
            return None
        item, waits = failure_limit(), []
        try:
            for bucket in buckets:
                if not self._limiter.hit(item, bucket):
                    waits.append(max(1.0, self._storage.get_expiry(item.key_for(bucket)) - time.time()))
        except _STORAGE_ERRORS as exc:
            self._breaker.trip(exc)
            return None
        return max(waits) if waits else None


@cache
def auth_failures(redis_url: str) -> AuthFailures:
    """The process's counter for a Redis URL (settings.REDIS_URL), built on first use."""
    return AuthFailures(redis_url)


class AsyncAuthFailures:
    """The same counts from an event loop (the gateway), on a `limits` asyncio storage of that loop."""

    def __init__(self, storage: AsyncStorage) -> None:
        self._storage = storage
        self._limiter = AsyncFixedWindowRateLimiter(storage)
        self._breaker = RedisBreaker("auth failure counts", meanwhile="not counting")

    async def refused(self, buckets: list[str]) -> float | None:
        """`AuthFailures.refused` from an event loop."""
        if self._breaker.open:
            return None
        item, waits = failure_limit(), []
        try:
            for bucket in buckets:
                if not await self._limiter.hit(item, bucket):
                    waits.append(max(1.0, await self._storage.get_expiry(item.key_for(bucket)) - time.time()))
        except _STORAGE_ERRORS as exc:
            self._breaker.trip(exc)
            return None
        return max(waits) if waits else None

    async def wait(self, bucket: str) -> float | None:
        """Seconds until `bucket` may try a key again, or None while it is under the limit."""
        if self._breaker.open:
            return None
        item = failure_limit()
        try:
            if await self._limiter.test(item, bucket):
                return None
            return max(1.0, await self._storage.get_expiry(item.key_for(bucket)) - time.time())
        except _STORAGE_ERRORS as exc:
            self._breaker.trip(exc)
            return None


def auth_failures_message(wait: float) -> str:
    return (
        f"Too many failed API key attempts from your address or with this key's prefix; retry in "
        f"{max(1, math.ceil(wait))} s. Check the key you send: it is shown once, when it is created."
    )


# ---------------------------------------------------------------------------------------------
# Requests per key or person, from the tenant's plan


class RateLimited(exceptions.Throttled):
    """429 `rate_limited`: a key or a person is over the tenant's API rate. `wait` becomes Retry-After."""

    default_code = "rate_limited"

    def __init__(self, *, wait: float, message: str) -> None:
        # Not Throttled.__init__: it would append its own "Expected available in …" to the message.
        exceptions.APIException.__init__(self, message, self.default_code)
        self.wait = max(1, math.ceil(wait))


def plan_rate(tenant: Tenant | None, *, write: bool) -> int:
    """Requests per minute a key or person may make: the tenant's plan, or its defaults without a tenant."""
    name = "api_write_rpm" if write else "api_read_rpm"
    if tenant is None:
        return int(Tenant._meta.get_field(name).get_default())
    return int(getattr(tenant, name))


def _ident(*, tenant: Tenant | None, key: ApiKey | None, user: Any) -> str | None:
    if key is not None:
        return f"key_{key.id}"
    if user is None or not getattr(user, "is_authenticated", False) or getattr(user, "pk", None) is None:
        return None
    # A person in several tenants is counted in each apart: each tenant's plan governs its own traffic.
    return f"user_{user.pk}" if tenant is None else f"user_{user.pk}_t{tenant.id}"


def _limit_message(*, tenant: Tenant | None, key: ApiKey | None, user: Any, write: bool, wait: float) -> str:
    kind = "writes" if write else "reads"
    limit = plan_rate(tenant, write=write)
    field = "api_write_rpm" if write else "api_read_rpm"
    retry = f" ({field}){burst_note(limit)}; retry in {max(1, math.ceil(wait))} s."
    if key is not None:
        return f"Key mint_{key.prefix}… is over its tenant's limit of {limit} API {kind} per minute{retry}"
    who = user.get_username()
    if tenant is None:
        return f"{who} is over the limit of {limit} API {kind} per minute{retry}"
    return f"{who} is over tenant {tenant.slug}'s limit of {limit} API {kind} per minute per person{retry}"


class ApiRateThrottle(SimpleRateThrottle):
    """DRF throttle of every tenant and staff API view: per key or person, reads and writes apart, at the plan's rate.

    Refuses with `RateLimited` (429 `rate_limited`, Retry-After, a message naming the limit) rather than
    returning False, so the answer can say whose limit it is. Runs after `TenantPermission`, which has
    resolved `request.access` (staff views have none: their rate is the plan fields' defaults).
    """

    cache_format = API_THROTTLE_KEY_BASE + "%(scope)s_%(ident)s"
    timer = time.time

    def __init__(self) -> None:
        # The rate comes from the caller's tenant, per request; SimpleRateThrottle would read it from settings.
        self.rate: str | None = None
        self._cache_key: str | None = None

    def get_cache_key(self, request, view) -> str | None:
        return self._cache_key

    def allow_request(self, request, view) -> bool:
        if getattr(request._request, "scope", {}).get(GATE_COUNTED):
            return True  # an upload, counted by the ASGI gate before its body was read (adapters/upload_gate.py)
        access = getattr(request, "access", None)
        tenant = access.tenant if access is not None else None
        key = access.actor.key if access is not None else None
        write = request.method not in READ_METHODS
        if write:
            refused = api_write_refusal(tenant=tenant, key=key, user=request.user)
            if refused is not None:
                raise refused
            return True
        wait = self.hit(tenant=tenant, key=key, user=request.user, write=write)
        if wait is None:
            return True
        raise RateLimited(
            wait=wait, message=_limit_message(tenant=tenant, key=key, user=request.user, write=write, wait=wait)
        )

    def throttle_success(self) -> bool:
        # Under the minute's rate; also under its burst? A minute's worth of writes at once (uploads, say) would
        # take the web server from every other tenant for seconds (benchmarks/noisy_neighbour_control.py).
        recent = sum(1 for moment in self.history if moment > self.now - BURST_WINDOW_S)
        if recent >= self.burst:
            self.burst_refused = True
            return self.throttle_failure()
        return super().throttle_success()

    def hit(self, *, tenant: Tenant | None, key: ApiKey | None, user: Any, write: bool) -> float | None:
        """Count one request; None if it is allowed, else the seconds until one is (the refused one is not counted)."""
        ident = _ident(tenant=tenant, key=key, user=user)
        if ident is None:
            return None
        return self._count(ident, plan_rate(tenant, write=write), "write" if write else "read")

    def hit_tenant(self, *, tenant: Tenant) -> float | None:
        """Count one write of the tenant's, whoever made it, against `api_tenant_write_rpm`: as `hit`."""
        return self._count(f"tenant_{tenant.id}", int(tenant.api_tenant_write_rpm), "write")

    def _count(self, ident: str, rate: int, scope: str) -> float | None:
        self.num_requests, self.duration = rate, WINDOW_S
        self.burst, self.burst_refused = burst_of(self.num_requests), False
        self.rate = f"{self.num_requests}/min"
        self._cache_key = self.cache_format % {"scope": scope, "ident": ident}
        try:
            if super().allow_request(None, None):
                return None
        except Exception:  # the cache (Redis) is down: let the request through rather than fail it
            log.warning("API throttle: cache unavailable; request %s not counted", self._cache_key, exc_info=True)
            return None
        if self.num_requests == 0 or not self.history:  # a plan of 0: no request ever fits
            return float(self.duration)
        if self.burst_refused:  # the burst-th newest must leave the last BURST_WINDOW_S
            return max(0.0, BURST_WINDOW_S - (self.now - self.history[self.burst - 1]))
        # The history is newest first; the request that must leave the window before one more fits is the
        # limit-th newest (DRF's own wait() spreads the wait over the free slots, which it has none of here).
        oldest_counted = self.history[self.num_requests - 1]
        return max(0.0, self.duration - (self.now - oldest_counted))


# Set in the ASGI scope of a request whose write was already counted by `api_write_wait`.
GATE_COUNTED = "mint.write_counted"


def api_write_check(*, tenant: Tenant, user: Any, scope: dict | None = None) -> None:
    """Count one write of a person outside DRF (a dashboard form) against the same limits as their API writes;
    `RateLimited` (429 naming the limit) when over one. A write the ASGI upload gate counted already is free."""
    if scope and scope.get(GATE_COUNTED):
        return
    refused = api_write_refusal(tenant=tenant, key=None, user=user)
    if refused is not None:
        raise refused


def api_write_refusal(*, tenant: Tenant | None, key: ApiKey | None, user: Any) -> RateLimited | None:
    """Count one write: against its key's or person's `api_write_rpm`, then, once that allows it, against the
    tenant's `api_tenant_write_rpm` (all its keys and people together, so that more keys do not mean more
    writes). None when both allow it, else the refusal naming the limit that was hit. A write refused by its
    key's limit does not count against the tenant's: one key past its own rate cannot use up its colleagues'.
    """
    wait = ApiRateThrottle().hit(tenant=tenant, key=key, user=user, write=True)
    if wait is not None:
        return RateLimited(wait=wait, message=_limit_message(tenant=tenant, key=key, user=user, write=True, wait=wait))
    if tenant is None or _ident(tenant=tenant, key=key, user=user) is None:
        return None
    wait = ApiRateThrottle().hit_tenant(tenant=tenant)
    if wait is None:
        return None
    limit = int(tenant.api_tenant_write_rpm)
    return RateLimited(
        wait=wait,
        message=f"Tenant {tenant.slug} is over its limit of {limit} API writes per minute for all its keys and "
        f"people together (api_tenant_write_rpm){burst_note(limit)}; retry in {max(1, math.ceil(wait))} s.",
    )


def api_write_wait(*, tenant: Tenant, key: ApiKey | None, user: Any) -> float | None:
    """Count one API write outside DRF against the same limits as `ApiRateThrottle` (`api_write_refusal`).

    Records the hit and returns None when it is allowed, else the seconds to wait.
    """
    refused = api_write_refusal(tenant=tenant, key=key, user=user)
    return None if refused is None else float(refused.wait)
