"""From a bearer token and a `model` string to a tenant, a revision and the nodes that serve it.

Both lookups are cached in-process for a short TTL so that a steady stream of requests
for a ready adapter does no database query at all; a change (a revoked key, an alias
flip, a placement becoming ready) is seen within that TTL, and at once where a live event
announces it (serving/gateway/feed.py: `api_key.changed` drops a tenant's or a key's cached
keys). Misses run the ORM through `sync_to_async`.

Failed authentications (a token that names no key, or a wrong secret) are counted per client
address in Redis (tenants/throttles.py, shared with the REST API); an address past the limit is
answered 429 before its token is looked up.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.utils import timezone
from limits.aio.storage import RedisStorage as AsyncRedisStorage

from adapters.models import Adapter, AdapterRevision, Alias, RevisionState
from serving.gateway import GatewayError, ratelimit, spawn
from serving.models import NodeState, Placement, PlacementState, Priority, lora_name
from tenants.access import Capability, key_access
from tenants.auth import FAILURE_CODE, KeyRefused, authenticate_token
from tenants.models import Scope
from tenants.throttles import AUTH_FAILURE_KEY_PREFIX, AsyncAuthFailures, auth_failures_message, client_bucket

log = logging.getLogger(__name__)

# The same rules as adapter and alias names in the REST API (adapters/serializers.py).
_ADAPTER = r"[a-z0-9][a-z0-9._-]{0,63}"
_MODEL_RE = re.compile(
    rf"^(?P<adapter>{_ADAPTER})(?::(?P<alias>[a-z][a-z0-9_-]{{0,31}})|@r(?P<number>[1-9][0-9]{{0,9}}))?$"
)

# A bound on each cache, so a flood of random tokens or model names cannot grow memory without limit.
_MAX_ENTRIES = 10_000


# Set by serving/gateway/feed.py while it is joined to the live events and receiving them.
following = False


def cache_ttl() -> float:
    """How long a route is cached: longer while live events keep routes fresh (serving/gateway/feed.py)."""
    if following:
        return float(settings.MINT_GATEWAY_FOLLOWED_CACHE_S)
    return float(settings.MINT_GATEWAY_CACHE_S)


def stale_window() -> float:
    """How long past its TTL a route is still served, while it is resolved again in the background.

    Only while the feed is live: events keep routes current, so the TTL only bounds the harm of a lost
    event, and the reload a late answer starts ends it. An adapter idle for longer than the TTL (most
    of a large catalog) then costs its next request no database round trip.
    """
    return float(settings.MINT_GATEWAY_FOLLOWED_STALE_S) if following else 0.0


def key_cache_ttl() -> float:
    return float(getattr(settings, "MINT_GATEWAY_KEY_CACHE_S", 5.0))


def not_ready_retry_after() -> int:
    return int(getattr(settings, "MINT_GATEWAY_NOT_READY_RETRY_S", 5))


class _TTLCache:
    """A dict whose entries expire; process-local, shared by every event loop of the process.

    An entry past half its TTL is "due": it is still served, and `refresh_ahead()` reloads it in
    the background, so a steady stream of requests for a hot key or route never waits on the
    database when the entry would have expired. Dropping entries bumps an epoch, and a
    background reload that started before a drop is discarded: it may have read older state.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[float, float, Any]] = {}
        self._reloading: set[Any] = set()
        self.epoch = 0

    def get(self, key: Any, *, stale_s: float = 0.0) -> tuple[bool, Any]:
        """(True, value) for an entry that has not expired, or expired less than `stale_s` ago (it is due)."""
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        expires, _, value = entry
        if expires + stale_s <= time.monotonic():
            self._entries.pop(key, None)
            return False, None
        return True, value

    def due(self, key: Any) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry[1] <= time.monotonic() and key not in self._reloading

    def put(self, key: Any, value: Any, ttl: float) -> None:
        if len(self._entries) >= _MAX_ENTRIES:
            now = time.monotonic()
            self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
        now = time.monotonic()
        self._entries[key] = (now + ttl, now + ttl / 2, value)

    def pop(self, key: Any) -> None:
        self._entries.pop(key, None)
        self.epoch += 1

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        """Drop every entry whose value matches; a reload already under way is discarded. Returns how many."""
        dropped = [key for key, (_, _, value) in self._entries.items() if predicate(value)]
        for key in dropped:
            del self._entries[key]
        self.epoch += 1
        return len(dropped)

    def cached_keys(self) -> list[Any]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._reloading.clear()
        self.epoch += 1

    def refresh_ahead(self, key: Any, load: Callable[[], Any], ttl: Callable[[], float]) -> None:
        """Reload a due entry in the background, one reload per key at a time; the caller uses the cached one."""
        if not self.due(key):
            return
        self._reloading.add(key)
        epoch = self.epoch

        async def reload() -> None:
            try:
                value = await sync_to_async(load)()
                if self.epoch == epoch:
                    self.put(key, value, ttl())
            except Exception:
                log.warning("gateway: background refresh of %r failed; it expires as usual", key, exc_info=True)
            finally:
                self._reloading.discard(key)

        spawn(reload(), name="gateway cache refresh")


def in_pool_thread(load: Callable[..., Any], *args: Any) -> Any:
    """Run an ORM read outside any request (a background task's thread): hand its connection back after."""
    try:
        return load(*args)
    finally:
        connections.close_all()


# ---------------------------------------------------------------------------------------------
# Keys


@dataclass(frozen=True)
class Caller:
    """What the gateway needs to know about a live key, without holding ORM objects across requests.

    `capabilities` are the key's scopes narrowed to its creator's role when it was authenticated; an
    `api_key.changed` event drops the entry when that role (or anything else here) changes.
    """

    key_id: int
    key_prefix: str
    scopes: tuple[str, ...]
    capabilities: frozenset[Capability]
    expires_at: datetime | None
    tenant_id: int
    tenant_slug: str
    rate_limit_rpm: int

    @property
    def can_infer(self) -> bool:
        return Capability.INFERENCE in self.capabilities


@dataclass(frozen=True)
class _Refusal:
    code: str
    message: str

    @property
    def counts_as_failure(self) -> bool:
        """A token that names no key (or not with that secret): counted against the client's address."""
        return self.code == FAILURE_CODE


_keys = _TTLCache()


def _authenticate_sync(token: str) -> Caller:
    # Checks the secret, revocation, expiry, tenant and creator; touches last_used_at. No client address:
    # failures are counted here, on the event loop, with redis.asyncio (`authenticate`).
    key = authenticate_token(token)
    return Caller(
        key_id=key.id,
        key_prefix=key.prefix,
        scopes=tuple(key.scopes),
        capabilities=key_access(key).capabilities,
        expires_at=key.expires_at,
        tenant_id=key.tenant_id,
        tenant_slug=key.tenant.slug,
        rate_limit_rpm=key.tenant.rate_limit_rpm,
    )


def _load_key(token: str) -> Caller | _Refusal:
    try:
        return _authenticate_sync(token)
    except KeyRefused as refused:
        codes = refused.get_codes()
        return _Refusal(codes if isinstance(codes, str) else "invalid_api_key", str(refused.detail))


def forget_keys(*, tenant_id: int | None = None, key_id: int | None = None) -> int:
    """Drop cached keys: one key, a tenant's keys, or every key (no arguments). Returns how many were dropped.

    Cached refusals about genuine keys (revoked, a creator without access, a suspended tenant) go too,
    whatever their tenant: the change may have made such a key work again. Refusals of tokens that name
    no key stay.
    """

    def stale(value: Caller | _Refusal) -> bool:
        if isinstance(value, _Refusal):
            return not value.counts_as_failure
        if key_id is not None:
            return value.key_id == key_id
        return tenant_id is None or value.tenant_id == tenant_id

    return _keys.drop_where(stale)


# One failure counter per event loop, on the loop's pooled Redis client of the rate limiter (its connections
# belong to the loop that opened them; serving/gateway/ratelimit.py closes them with the loop).
_failure_counters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, AsyncAuthFailures]] = (
    weakref.WeakKeyDictionary()
)


def _auth_failures() -> AsyncAuthFailures:
    pool = ratelimit._client().connection_pool
    loop = asyncio.get_running_loop()
    known = _failure_counters.get(loop)
    if known is None or known[0] is not pool:
        storage = AsyncRedisStorage(
            f"async+{settings.REDIS_URL}",
            implementation="redispy",
            key_prefix=AUTH_FAILURE_KEY_PREFIX,
            wrap_exceptions=True,
            connection_pool=pool,
        )
        known = _failure_counters[loop] = (pool, AsyncAuthFailures(storage))
    return known[1]


async def authenticate(authorization: str, *, client: str | None = None) -> Caller:
    """The caller an `Authorization` header names, or a 401/403/429 `GatewayError`.

    Cached by the token's SHA-256 (never the token itself) for MINT_GATEWAY_KEY_CACHE_S,
    refreshed in the background after half of it; an `api_key.changed` event (a revocation, a
    change of the creator's rights) drops the entry at once. Refusals are cached too, so a client
    hammering with a bad key costs one query per TTL, not one per request.

    `client` is the caller's address (the ASGI scope's, which uvicorn takes from trusted proxies
    only). A token not already known to be valid is checked against the address's failure count
    first: past MINT_AUTH_FAILURES_PER_MIN failures this minute, 429 before any lookup. A token
    cached as valid is served without that check: it cannot be a guess.
    """
    kind, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if kind.lower() != "bearer" or not token:
        raise GatewayError(
            401, "missing_api_key", "Send an API key with scope inference as `Authorization: Bearer mint_…`."
        )
    digest = hashlib.sha256(token.encode()).hexdigest()
    hit, cached = _keys.get(digest)
    bucket = client_bucket(client)
    failures = _auth_failures() if bucket is not None and not isinstance(cached, Caller) else None
    if failures is not None and (wait := await failures.wait(bucket)) is not None:
        raise GatewayError(
            429,
            "too_many_auth_failures",
            auth_failures_message(wait),
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
    if not hit:
        epoch = _keys.epoch
        cached = await sync_to_async(_load_key)(token)
        # An event that dropped keys while this was reading may have been about this key: use the answer
        # for this request, but do not keep it (the next request reads again).
        if _keys.epoch == epoch:
            _keys.put(digest, cached, key_cache_ttl())
    else:
        _keys.refresh_ahead(digest, lambda: in_pool_thread(_load_key, token), key_cache_ttl)
    if isinstance(cached, _Refusal):
        if failures is not None and cached.counts_as_failure:
            await failures.record(bucket)
        # A fresh exception each time: re-raising one cached instance would grow its traceback forever.
        raise GatewayError(401, cached.code, cached.message)
    caller: Caller = cached
    if caller.expires_at is not None and caller.expires_at <= timezone.now():
        _keys.pop(digest)
        raise GatewayError(
            401,
            "api_key_expired",
            f"The API key mint_{caller.key_prefix}_… expired at {caller.expires_at.isoformat()}.",
        )
    if not caller.can_infer:
        raise GatewayError(
            403,
            "insufficient_scope",
            f"This key's scopes ({', '.join(caller.scopes) or 'none'}) do not allow inference; "
            f"it needs a key with scope {Scope.INFERENCE}.",
        )
    return caller


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelRef:
    """A parsed `model` string: `<adapter>`, `<adapter>:<alias>` or `<adapter>@r<n>`."""

    adapter: str
    alias: str | None = None
    number: int | None = None

    @property
    def alias_name(self) -> str | None:
        """The alias this names (`production` for a bare adapter), or None for a pinned revision."""
        if self.number is not None:
            return None
        return self.alias or Alias.PRODUCTION


def parse_model(value: Any) -> ModelRef:
    """Parse a `model` string, or raise a 400 `GatewayError` that says what the forms are."""
    if not isinstance(value, str) or not value:
        raise GatewayError(400, "missing_model", "The request body must name a `model` (a string).")
    match = _MODEL_RE.match(value)
    if match is None:
        raise GatewayError(
            400,
            "invalid_model",
            f"`model` {value[:200]!r} is not valid: use <adapter>, <adapter>:<alias> or <adapter>@r<n>.",
        )
    number = match.group("number")
    return ModelRef(adapter=match.group("adapter"), alias=match.group("alias"), number=int(number) if number else None)


def model_not_found(model: str) -> GatewayError:
    # The same answer whether the adapter does not exist or belongs to another tenant.
    return GatewayError(
        404, "model_not_found", f"The model {model[:200]!r} does not exist or you have no access to it."
    )


@dataclass(frozen=True)
class Target:
    """One ready placement of a revision: where to send a request and under which LoRA name."""

    placement_id: int
    node_name: str
    node_url: str
    lora_name: str


@dataclass(frozen=True)
class Resolution:
    """A revision a model string points at now, and its ready placements (possibly none)."""

    adapter_id: int
    adapter_name: str
    revision_id: int
    revision_number: int
    lora_name: str
    targets: tuple[Target, ...]


class _NotFound(Exception):
    pass


@dataclass(frozen=True)
class _AliasNotLive:
    adapter_name: str
    alias: str


_resolutions = _TTLCache()
_prewarmed = _TTLCache()  # revision id → True while a cold-request prewarm was asked for within the TTL


def _resolve_sync(tenant_id: int, ref: ModelRef) -> Resolution | _AliasNotLive | None:
    adapter = Adapter.objects.filter(tenant_id=tenant_id, name=ref.adapter).only("id", "name", "tenant_id").first()
    if adapter is None:
        return None
    if ref.number is not None:
        revision = AdapterRevision.objects.filter(
            adapter=adapter, number=ref.number, state=RevisionState.APPROVED
        ).first()
        if revision is None:
            return None
    else:
        alias = Alias.objects.filter(adapter=adapter, name=ref.alias_name).select_related("revision").first()
        if alias is None or alias.revision is None:
            return _AliasNotLive(adapter_name=adapter.name, alias=ref.alias_name)
        revision = alias.revision
    revision.adapter = adapter  # lora_name() reads the tenant through it; no extra query
    name = lora_name(revision)
    placements = (
        Placement.objects.filter(revision=revision, state=PlacementState.READY, node__state=NodeState.UP)
        .select_related("node")
        .order_by("id")
    )
    targets = tuple(
        Target(placement_id=p.id, node_name=p.node.name, node_url=p.node.url.rstrip("/"), lora_name=name)
        for p in placements
    )
    return Resolution(
        adapter_id=adapter.id,
        adapter_name=adapter.name,
        revision_id=revision.id,
        revision_number=revision.number,
        lora_name=name,
        targets=targets,
    )


class NotReady(GatewayError):
    """503 adapter_not_ready; carries the adapter name for metrics."""

    def __init__(self, message: str, *, adapter_name: str):
        super().__init__(503, "adapter_not_ready", message, headers={"Retry-After": str(not_ready_retry_after())})
        self.adapter_name = adapter_name


async def resolve(tenant_id: int, ref: ModelRef, model: str) -> Resolution:
    """The revision `ref` names for this tenant and its ready targets, or a 404/503 `GatewayError`.

    A revision with no ready placement answers 503 at once and asks (at most once per
    revision per TTL, in the background) for a cold-request prewarm: no request ever
    waits on a load.
    """
    key = (tenant_id, ref)
    hit, found = _resolutions.get(key, stale_s=stale_window())
    if not hit:
        found = await sync_to_async(_resolve_sync)(tenant_id, ref)
        _resolutions.put(key, found, cache_ttl())
    else:
        _resolutions.refresh_ahead(key, lambda: in_pool_thread(_resolve_sync, tenant_id, ref), cache_ttl)
    if found is None:
        raise model_not_found(model)
    if isinstance(found, _AliasNotLive):
        raise NotReady(
            f"Adapter {found.adapter_name!r} has no live revision under alias {found.alias!r} yet.",
            adapter_name=found.adapter_name,
        )
    if not found.targets:
        schedule_prewarm(found.revision_id)
        raise NotReady(
            f"Revision r{found.revision_number} of adapter {found.adapter_name!r} is not loaded yet; "
            "it is being prepared, retry shortly.",
            adapter_name=found.adapter_name,
        )
    return found


def forget(tenant_id: int, ref: ModelRef) -> None:
    """Drop a cached resolution (a node said it does not hold the adapter after all)."""
    _resolutions.pop((tenant_id, ref))


def invalidate(*, tenant_id: int | None = None, adapter: str | None = None) -> list[tuple[int, ModelRef]]:
    """Drop the cached routes of one adapter of a tenant (or every route, without a tenant); return their keys."""
    dropped = [
        key
        for key in _resolutions.cached_keys()
        if tenant_id is None or (key[0] == tenant_id and (adapter is None or key[1].adapter == adapter))
    ]
    for key in dropped:
        _resolutions.pop(key)
    if tenant_id is None:
        _model_lists.clear()
    else:
        _model_lists.pop(tenant_id)
    return dropped


async def prefetch(keys: list[tuple[int, ModelRef]]) -> None:
    """Resolve routes now, so the next request for them finds them cached."""
    for tenant_id, ref in keys:
        found = await sync_to_async(in_pool_thread)(_resolve_sync, tenant_id, ref)
        _resolutions.put((tenant_id, ref), found, cache_ttl())


def schedule_prewarm(revision_id: int) -> bool:
    """Ask for a cold-request placement of a revision in the background, at most once per TTL. True if asked."""
    hit, _ = _prewarmed.get(revision_id)
    if hit:
        return False
    _prewarmed.put(revision_id, True, cache_ttl())
    prewarm = sync_to_async(in_pool_thread, thread_sensitive=False)(_prewarm_sync, revision_id)
    spawn(prewarm, name=f"prewarm r{revision_id}")
    return True


def _prewarm_sync(revision_id: int) -> None:
    from serving import services  # looked up at call time: the service may be patched or still being written

    try:
        revision = AdapterRevision.objects.select_related("adapter").filter(id=revision_id).first()
        if revision is None:
            return
        services.placement_request(revision=revision, priority=Priority.COLD_REQUEST)
    except Exception:
        # The 503 already went out; the next cold request after the TTL asks again.
        log.exception("cold-request prewarm of revision %s failed", revision_id)


# ---------------------------------------------------------------------------------------------
# The model list


@dataclass(frozen=True)
class ModelEntry:
    id: str
    created: int


_model_lists = _TTLCache()


def _model_list_sync(tenant_id: int) -> tuple[ModelEntry, ...]:
    aliases = (
        Alias.objects.filter(adapter__tenant_id=tenant_id, revision__isnull=False)
        .select_related("adapter")
        .only("name", "adapter__name", "adapter__created_at")
    )
    entries = [
        ModelEntry(
            id=a.adapter.name if a.name == Alias.PRODUCTION else f"{a.adapter.name}:{a.name}",
            created=int(a.adapter.created_at.timestamp()),
        )
        for a in aliases
    ]
    return tuple(sorted(entries, key=lambda e: e.id))


async def model_list(tenant_id: int) -> tuple[ModelEntry, ...]:
    """The tenant's servable model ids: each adapter with a live production alias, plus `<adapter>:<alias>`."""
    hit, entries = _model_lists.get(tenant_id)
    if not hit:
        entries = await sync_to_async(_model_list_sync)(tenant_id)
        _model_lists.put(tenant_id, entries, cache_ttl())
    return entries


def clear() -> None:
    """Forget every cached key, resolution, model list and prewarm mark (tests)."""
    for cache in (_keys, _resolutions, _prewarmed, _model_lists):
        cache.clear()
