"""From an `Authorization: Bearer …` header to the `Caller` a request acts for.

The key itself is checked by the same code as the REST API's (`tenants.auth.live_key`: secret, revocation,
expiry, tenant, creator), on a database thread, and the answer, a `Caller` or the refusal, is cached by the
token's SHA-256 for MINT_GATEWAY_KEY_CACHE_S (refreshed in the background after half of it); an
`api_key.changed` live event (serving/gateway/feed.py) drops it at once. Bearer parsing and expiry are
`tenants.keys`'s; the key's use is recorded in batches (serving/gateway/usage.py).

The key cache is shared out (serving/gateway/caches.py, `key_share`): each tenant's keys at most
TENANT_SHARE (2,500) entries; refusals of tokens that name no key, and refusals of genuine keys, each at
most SHARED_MISSES (1,000) apart from them. No flood of guesses or of one tenant's keys evicts another
tenant's valid key, and an event about one tenant's keys discards only lookups of that tenant's keys (and
of refused genuine keys).

Failed authentications (a token that names no key, or a wrong secret) are counted per client address, and per
key for a wrong secret, in Redis (tenants/throttles.py, shared with the REST API). They never refuse a valid
key: the token is checked first (a cached key costs nothing more), and only a refused token meets the counts,
answered 429 instead of 401 once they are past MINT_AUTH_FAILURES_PER_MIN. An address past its limit, or with
that many lookups in flight, has its uncached tokens looked up in batches on a database thread of its own
(serving/gateway/batches.py): a flood of guesses costs one query per batch, and never the database threads
other tenants' misses use.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field, make_dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from django.conf import settings
from django.utils import timezone

from serving.gateway import GatewayError
from serving.gateway.batches import Full
from tenants.access import Capability, key_access
from tenants.auth import FAILURE_CODE, KeyRefused, live_key, live_keys
from tenants.keys import bearer_token, expiry_refusal
from tenants.models import Scope, Tenant
from tenants.models.tenant import GATEWAY_PLAN_FIELDS
from tenants.throttles import auth_failures_message, client_bucket, failure_buckets

if TYPE_CHECKING:
    from serving.gateway.background import DatabaseThreads
    from serving.gateway.batches import BatchedLookups
    from serving.gateway.caches import RefreshingCache
    from tenants.throttles import AsyncAuthFailures


class KeyState(Protocol):
    """What authentication reads and keeps in the gateway's state (serving/gateway/state.py builds it)."""

    keys: RefreshingCache  # token SHA-256 → Caller, or the refusal to repeat
    suspect_keys: BatchedLookups  # lookups of clients that look like they are guessing, in batches
    db: DatabaseThreads
    key_lookups: dict[str, asyncio.Future]  # token SHA-256 → its lookup in flight
    lookups_by_client: Counter[str]  # key lookups in flight per client address

    def auth_failures(self) -> AsyncAuthFailures: ...


# The tenant's plan limits the gateway enforces per request, copied off the tenant (no ORM object is held across
# requests): an int for each of tenants' GATEWAY_PLAN_FIELDS, whose meaning and default are the Tenant field's.
GatewayPlan = make_dataclass(
    "GatewayPlan",
    [(name, int, field(default=Tenant._meta.get_field(name).default)) for name in GATEWAY_PLAN_FIELDS],
    frozen=True,
    namespace={"of": classmethod(lambda cls, tenant: cls(**{n: getattr(tenant, n) for n in GATEWAY_PLAN_FIELDS}))},
)


@dataclass(frozen=True)
class Caller:
    """What the gateway needs to know about a live key, without holding ORM objects across requests.

    `capabilities` are the key's scopes narrowed to its creator's role when it was authenticated; an
    `api_key.changed` event drops the entry when that role (or anything else here) changes. `adapters` is the
    key's allow-list (empty: every adapter of its tenant); the token limits are the key's own (None: only its
    tenant's plan applies).
    """

    key_id: int
    key_prefix: str
    scopes: tuple[str, ...]
    capabilities: frozenset[Capability]
    expires_at: datetime | None
    tenant_id: int
    tenant_slug: str
    plan: GatewayPlan = field(default_factory=GatewayPlan)
    adapters: frozenset[str] = frozenset()
    max_tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None

    @property
    def rate_limit_rpm(self) -> int:
        return self.plan.rate_limit_rpm

    @property
    def can_infer(self) -> bool:
        return Capability.INFERENCE in self.capabilities

    @property
    def can_sample(self) -> bool:
        """May call any exported revision of its tenant by number, approved or not (serving/gateway/sampling.py)."""
        return Capability.SAMPLE in self.capabilities

    def may_call(self, adapter_name: str) -> bool:
        """Whether the key's allow-list lets it call this adapter (any, when the list is empty)."""
        return not self.adapters or adapter_name in self.adapters


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    wrong_secret_of: str | None = None  # the existing key's prefix, for a wrong secret (counted per key too)

    @property
    def counts_as_failure(self) -> bool:
        """A token that names no key (or not with that secret): counted against the client's address."""
        return self.code == FAILURE_CODE


def load_key(token: str) -> Caller | Refusal:
    """The caller a token names, or why not (ORM: run it on a database thread)."""
    try:
        return caller_of(live_key(token))
    except KeyRefused as refused:
        return refusal_of(refused)


def load_keys(tokens: list[str]) -> list[Caller | Refusal]:
    """`load_key` of many tokens at once, most of them guesses (one query for all their prefixes)."""
    return [refusal_of(found) if isinstance(found, KeyRefused) else caller_of(found) for found in live_keys(tokens)]


def refusal_of(refused: KeyRefused) -> Refusal:
    codes = refused.get_codes()
    return Refusal(codes if isinstance(codes, str) else "invalid_api_key", str(refused.detail), refused.wrong_secret_of)


def caller_of(key) -> Caller:
    return Caller(
        key_id=key.id,
        key_prefix=key.prefix,
        scopes=tuple(key.scopes),
        capabilities=key_access(key).capabilities,
        expires_at=key.expires_at,
        tenant_id=key.tenant_id,
        tenant_slug=key.tenant.slug,
        plan=GatewayPlan.of(key.tenant),
        adapters=frozenset(key.adapters or ()),
        max_tokens_per_minute=key.max_tokens_per_minute,
        monthly_token_budget=key.monthly_token_budget,
    )


# The key cache's shares (serving/gateway/caches.py) that belong to no tenant: each bounded apart from every
# tenant's keys, so that no flood of refusals evicts a valid key.
REFUSED_KEYS = "refused keys"  # genuine keys refused (revoked, expired, a creator without access, …)
UNKNOWN_TOKENS = "unknown tokens"  # tokens that name no key, or not with that secret: guesses


def key_share(_digest: str, found: Caller | Refusal) -> tuple[int | str, bool]:
    """Whose share of the key cache an answer counts against: the key's tenant, or one of the refusals'."""
    if isinstance(found, Caller):
        return found.tenant_id, False
    return (UNKNOWN_TOKENS if found.counts_as_failure else REFUSED_KEYS), True


def forget_keys(state: KeyState, *, tenant_id: int | None = None, key_id: int | None = None) -> int:
    """Drop cached keys: one key, a tenant's keys, or every key (no arguments). Returns how many were dropped.

    Cached refusals about genuine keys (revoked, a creator without access, a suspended tenant) go too,
    whatever their tenant: the change may have made such a key work again. Refusals of tokens that name
    no key stay. A lookup or reload under way is discarded only if it is about what this drops (that key,
    that tenant's keys, a genuine key's refusal): another tenant's keys keep refreshing.
    """

    def stale(_digest: str, value: Caller | Refusal) -> bool:
        if isinstance(value, Refusal):
            return not value.counts_as_failure
        if key_id is not None:
            return value.key_id == key_id
        return tenant_id is None or value.tenant_id == tenant_id

    owners = None if tenant_id is None else (tenant_id, REFUSED_KEYS)  # where such entries can be
    return len(state.keys.drop_where(stale, owners=owners))


async def _suspect(state: KeyState, bucket: str | None) -> bool:
    """Whether a client's uncached tokens go to the batched lane: it has MINT_AUTH_FAILURES_PER_MIN lookups in
    flight already, or is past its failure limit (one Redis read, on a cache miss only)."""
    if bucket is None:
        return False
    if _busy(state, bucket):
        return True
    return await state.auth_failures().wait(bucket) is not None


def _busy(state: KeyState, bucket: str | None) -> bool:
    return bucket is not None and state.lookups_by_client[bucket] >= settings.MINT_AUTH_FAILURES_PER_MIN


async def _looked_up(state: KeyState, digest: str, token: str, bucket: str | None) -> Caller | Refusal:
    """The key a token names, read once however many requests carry it at the same moment.

    A client that is not suspect has its lookups run on the database threads every tenant's misses share, at
    most MINT_AUTH_FAILURES_PER_MIN at once; a suspect one (`_suspect`) waits for the batched lane, which a
    valid key gets through too. Only a full lane refuses (429).
    """
    pending = state.key_lookups.get(digest)
    if pending is None:
        suspect = await _suspect(state, bucket)
        pending = state.key_lookups.get(digest)  # started by another request meanwhile
    if pending is None:
        # No await from here until the lookup is registered: the in-flight count holds across requests.
        loading = state.keys.loading(digest)
        counted = None
        if suspect or _busy(state, bucket):
            try:
                pending = state.suspect_keys.submit(token)
            except Full:
                loading.cancel()
                raise GatewayError(
                    429, "too_many_auth_failures", auth_failures_message(1.0), headers={"Retry-After": "1"}
                ) from None
        else:
            pending = asyncio.ensure_future(state.db.run(load_key, token))
            if bucket is not None:
                counted = bucket
                state.lookups_by_client[bucket] += 1
        state.key_lookups[digest] = pending

        def done(future: asyncio.Future) -> None:
            state.key_lookups.pop(digest, None)
            if counted is not None:
                state.lookups_by_client[counted] -= 1
                if state.lookups_by_client[counted] <= 0:
                    del state.lookups_by_client[counted]
            # An event that dropped this key (or its tenant's keys) while this was reading: the answer serves
            # the requests waiting for it, but is not kept (the next request reads again). Events about other
            # tenants' keys do not concern it.
            if not future.cancelled() and future.exception() is None:
                loading.keep(future.result())
            else:
                loading.cancel()

        pending.add_done_callback(done)
    return await asyncio.shield(pending)  # one caller giving up does not cancel the others' lookup


async def authenticate(state: KeyState, authorization: str, *, client: str | None = None) -> Caller:
    """The caller an `Authorization` header names, or a 401/403/429 `GatewayError`.

    The token is checked first: from the cache, else looked up (`_looked_up`). Refusals are cached too, so a
    client hammering with one bad key costs one query per TTL, not one per request. A refused guess counts
    against the client's address (`client`: the ASGI scope's, which uvicorn takes from trusted proxies only)
    and, for a wrong secret, against that key; past MINT_AUTH_FAILURES_PER_MIN this minute it is answered 429
    rather than 401. A valid key is never refused for its address's failures.
    """
    token = bearer_token(authorization)
    if not token:
        raise GatewayError(
            401, "missing_api_key", "Send an API key with scope inference as `Authorization: Bearer mint_…`."
        )
    digest = hashlib.sha256(token.encode()).hexdigest()
    hit, cached = state.keys.get(digest)
    if not hit:
        cached = await _looked_up(state, digest, token, client_bucket(client))
    else:
        state.keys.refresh_ahead(digest, lambda: state.db.run(load_key, token))
    if isinstance(cached, Refusal):
        if cached.counts_as_failure:
            buckets = failure_buckets(client=client, wrong_secret_of=cached.wrong_secret_of)
            if buckets and (wait := await state.auth_failures().refused(buckets)) is not None:
                raise GatewayError(
                    429,
                    "too_many_auth_failures",
                    auth_failures_message(wait),
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        # A fresh exception each time: re-raising one cached instance would grow its traceback forever.
        raise GatewayError(401, cached.code, cached.message)
    caller: Caller = cached
    if expired := expiry_refusal(prefix=caller.key_prefix, expires_at=caller.expires_at, now=timezone.now()):
        state.keys.pop(digest)
        raise GatewayError(401, "api_key_expired", expired)
    if not caller.can_infer and not caller.can_sample:
        raise GatewayError(
            403,
            "insufficient_scope",
            f"This key's scopes ({', '.join(caller.scopes) or 'none'}) do not allow inference; "
            f"it needs a key with scope {Scope.INFERENCE} (or, to sample revisions by number, "
            f"{Scope.PIPELINE} or {Scope.SAMPLING}).",
        )
    return caller
