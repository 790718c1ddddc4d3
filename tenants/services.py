"""Writes for tenants, members and keys. Each writes its audit event in the same transaction."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Case, DateTimeField, Q, Value, When
from django.utils import timezone

from mint_site.errors import Conflict, MintError, QuotaExceeded
from mint_site.events import live_event
from mint_site.names import ADAPTER_NAME_PATTERN
from tenants.access import Actor
from tenants.keys import new_token, touch_due
from tenants.models import ApiKey, AuditEvent, Membership, Role, Scope, Tenant


def audit_record(
    *,
    tenant: Tenant | None,
    actor: Actor,
    action: str,
    target: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEvent:
    """Append one audit event. Call it inside the transaction of the change it records."""
    user = actor.user if actor.user is not None and actor.user.pk is not None else None
    return AuditEvent.objects.create(
        tenant=tenant,
        tenant_slug=tenant.slug if tenant is not None else "",
        actor_user=user,
        actor_key=actor.key,
        actor=actor.label,
        action=action,
        target=target,
        before=before,
        after=after,
    )


@transaction.atomic
def tenant_create(*, slug: str, name: str = "", owner: AbstractBaseUser, by: Actor) -> Tenant:
    """Create a tenant with `owner` as its first owner."""
    if Tenant.objects.filter(slug=slug).exists():
        raise Conflict(f"A tenant with slug {slug!r} already exists.", code="tenant_exists")
    tenant = Tenant.objects.create(slug=slug, name=name or slug)
    Membership.objects.create(user=owner, tenant=tenant, role=Role.OWNER)
    audit_record(
        tenant=tenant,
        actor=by,
        action="tenant.create",
        target=f"tenant:{slug}",
        after={"slug": slug, "name": tenant.name, "owner": owner.get_username()},
    )
    return tenant


# The live event that tells every gateway process to authenticate a tenant's keys (or one key) again.
API_KEY_CHANGED = "api_key.changed"


def api_keys_changed(*, tenant_id: int, reason: str, key_id: int | None = None) -> None:
    """Announce, once committed, that what a tenant's keys (or one key) may do has changed.

    Gateway processes cache authenticated keys (serving/gateway/resolve.py); on this event they drop
    the tenant's (or the key's) entries, so a revocation or a change of their creators' rights is seen
    by the next request, not at the end of the cache's TTL. `reason`: revoked, membership, person, tenant.
    """
    live_event(tenant_id=tenant_id, type=API_KEY_CHANGED, id=key_id or tenant_id, state=reason, key=key_id)


# The live event of a change to a tenant's people (the members page follows it; webhooks/ sends it as `member.*`).
MEMBER_CHANGED = "member.state"


def member_event(*, tenant_id: int, state: str, member: str, role: str | None, by: Actor, id: int) -> None:
    """Announce, once committed, a change to a tenant's people: `state` is invited, invitation_revoked, joined,
    role_changed or removed; `member` the username (or, for an invitation, the address it went to)."""
    live_event(
        tenant_id=tenant_id,
        type=MEMBER_CHANGED,
        id=id,
        state=state,
        member=member,
        role=role,
        by=by.label,
        subject=f"member:{member}",
    )


@transaction.atomic
def membership_set(*, tenant: Tenant, user: AbstractBaseUser, role: str, by: Actor) -> Membership:
    """Add `user` to `tenant` with `role`, or change the role they have. Their keys follow at once."""
    if role not in Role.values:
        raise MintError(f"Unknown role {role!r}; use one of {', '.join(Role.values)}.", code="invalid_role")
    membership = Membership.objects.select_for_update().filter(tenant=tenant, user=user).first()
    before = {"role": membership.role} if membership else None
    if membership is None:
        membership = Membership.objects.create(tenant=tenant, user=user, role=role)
        api_keys_changed(tenant_id=tenant.id, reason="membership")
        member_event(tenant_id=tenant.id, state="joined", member=user.get_username(), role=role, by=by, id=user.pk)
    elif membership.role != role:
        _keep_an_owner(tenant=tenant, leaving=membership)
        membership.role = role
        membership.save(update_fields=["role"])
        api_keys_changed(tenant_id=tenant.id, reason="membership")
        member_event(
            tenant_id=tenant.id, state="role_changed", member=user.get_username(), role=role, by=by, id=user.pk
        )
    audit_record(
        tenant=tenant,
        actor=by,
        action="membership.set",
        target=f"member:{user.get_username()}",
        before=before,
        after={"role": role},
    )
    return membership


@transaction.atomic
def membership_remove(*, tenant: Tenant, user: AbstractBaseUser, by: Actor) -> None:
    """Remove `user` from `tenant`. The keys they created there stop working at once (401 api_key_owner_inactive)."""
    membership = Membership.objects.select_for_update().filter(tenant=tenant, user=user).first()
    if membership is None:
        raise MintError(f"{user.get_username()} is not a member of {tenant.slug}.", code="not_a_member")
    _keep_an_owner(tenant=tenant, leaving=membership)
    membership.delete()
    api_keys_changed(tenant_id=tenant.id, reason="membership")
    member_event(tenant_id=tenant.id, state="removed", member=user.get_username(), role=None, by=by, id=user.pk)
    audit_record(
        tenant=tenant,
        actor=by,
        action="membership.remove",
        target=f"member:{user.get_username()}",
        before={"role": membership.role},
    )


def _keep_an_owner(*, tenant: Tenant, leaving: Membership) -> None:
    if leaving.role != Role.OWNER:
        return
    others = Membership.objects.select_for_update().filter(tenant=tenant, role=Role.OWNER).exclude(id=leaving.id)
    if not others.exists():
        raise Conflict(f"{tenant.slug} would have no owner left.", code="last_owner")


def _clean_scopes(scopes: Iterable[str]) -> list[str]:
    cleaned = sorted({scope.strip() for scope in scopes if scope.strip()})
    unknown = [scope for scope in cleaned if scope not in Scope.values]
    if unknown:
        raise MintError(
            f"Unknown scope(s) {', '.join(unknown)}; use {', '.join(Scope.values)}.",
            code="invalid_scope",
            detail={"scopes": unknown},
        )
    if not cleaned:
        raise MintError("A key needs at least one scope.", code="invalid_scope")
    return cleaned


_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)


def _clean_adapters(names: Iterable[str]) -> list[str]:
    """A key's allow-list: adapter names, each in the adapters' own form, at most MINT_KEY_MAX_ADAPTERS of them.

    Names are not looked up: tenants know nothing of adapters, and a key may be made before the adapter it is
    for. A name that names nothing grants nothing (the gateway answers 404, as for any absent model).
    """
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise MintError("adapters must be a list of adapter names.", detail={"adapters": ["must be a list"]})
    names = list(names)
    if any(not isinstance(name, str) for name in names):
        raise MintError("adapters must be a list of adapter names.", detail={"adapters": ["must be strings"]})
    cleaned = sorted({name.strip() for name in names})
    limit = settings.MINT_KEY_MAX_ADAPTERS
    if len(cleaned) > limit:
        raise MintError(
            f"adapters: a key may name at most {limit} adapters ({len(cleaned)} given).",
            code="too_many_adapters",
            detail={"adapters": [f"at most {limit} names"]},
        )
    bad = [name for name in cleaned if not _ADAPTER_NAME.fullmatch(name)]
    if bad:
        shown = ", ".join(repr(name[:70]) for name in bad[:5])
        raise MintError(
            f"adapters: {shown} {'is' if len(bad) == 1 else 'are'} not adapter names (lower-case letters, digits, "
            "'.', '_' and '-', starting with a letter or digit, at most 64 characters).",
            code="invalid_adapter_name",
            detail={"adapters": [f"not an adapter name: {name[:70]!r}" for name in bad[:20]]},
        )
    return cleaned


# A key's own token limits, beside the tenant's plan field each narrows.
KEY_TOKEN_LIMITS = ("max_tokens_per_minute", "monthly_token_budget")


def _clean_token_limits(*, tenant: Tenant, limits: Mapping[str, Any]) -> dict[str, int | None]:
    """A key's token limits: each empty (only the tenant's applies) or a whole number from 1 to the tenant's.

    A key only narrows its tenant's plan: it cannot be given more than the tenant has (where the tenant has a
    limit). Both are checked at the gateway, so a plan lowered later still binds keys made before.
    """
    cleaned: dict[str, int | None] = {}
    errors: dict[str, list[str]] = {}
    for name in KEY_TOKEN_LIMITS:
        raw = limits.get(name)
        if raw is None or raw == "":
            cleaned[name] = None
            continue
        if isinstance(raw, bool):
            errors[name] = ["must be a whole number"]
            continue
        try:
            value = ApiKey._meta.get_field(name).clean(raw, None)
        except ValidationError as exc:
            errors[name] = exc.messages
            continue
        plan = getattr(tenant, name)
        if value < 1:
            errors[name] = ["must be at least 1 (leave it empty for no limit of the key's own)"]
        elif plan and value > plan:
            errors[name] = [f"must be at most the tenant's {name} ({plan})"]
        else:
            cleaned[name] = value
    if errors:
        message = "; ".join(f"{name}: {' '.join(messages)}" for name, messages in errors.items())
        raise MintError(message, code="invalid_request", detail=errors)
    return cleaned


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str],
    created_by: AbstractBaseUser | None,
    by: Actor,
    expires_at: datetime | None = None,
    adapters: Iterable[str] = (),
    max_tokens_per_minute: int | None = None,
    monthly_token_budget: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its token. The token exists only in this return value.

    `adapters` lists the adapters the key may call through the gateway (empty: all of the tenant's);
    `max_tokens_per_minute` and `monthly_token_budget` are the key's own limits within its tenant's. All three
    are fixed for the key's life: a key with other limits is a new key.
    """
    clean = _clean_scopes(scopes)
    if expires_at is not None and expires_at <= timezone.now():
        raise MintError(
            "expires_at must be in the future.",
            code="invalid_request",
            detail={"expires_at": ["must be in the future"]},
        )
    allowed = _clean_adapters(adapters)
    _check_key_quota(tenant)
    limits = _clean_token_limits(
        tenant=tenant,
        limits={"max_tokens_per_minute": max_tokens_per_minute, "monthly_token_budget": monthly_token_budget},
    )
    token, prefix, key_hash = new_token()
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=prefix,
        key_hash=key_hash,
        scopes=clean,
        created_by=created_by,
        expires_at=expires_at,
        adapters=allowed,
        **limits,
    )
    audit_record(
        tenant=tenant,
        actor=by,
        action="api_key.create",
        target=f"api_key:{prefix}",
        after={
            "name": name,
            "scopes": clean,
            "expires_at": expires_at.isoformat() if expires_at else None,
            "adapters": allowed,
            **limits,
        },
    )
    return key, token


def _check_key_quota(tenant: Tenant) -> None:
    """Refuse a key past the plan's `max_api_keys` live ones; the tenant's row lock serialises the count."""
    locked = Tenant.objects.select_for_update().get(id=tenant.id)
    now = timezone.now()
    live = ApiKey.objects.filter(tenant=locked, revoked_at__isnull=True).exclude(expires_at__lte=now).count()
    if live >= locked.max_api_keys:
        raise QuotaExceeded(
            f"Tenant {locked.slug} already has {live} live API keys, its limit (max_api_keys={locked.max_api_keys}); "
            "revoke one first.",
            code="key_quota_exceeded",
            detail={"quota": "max_api_keys", "limit": locked.max_api_keys},
        )


@transaction.atomic
def api_key_revoke(*, key: ApiKey, by: Actor) -> ApiKey:
    """Revoke a key at once (gateway processes drop it from their caches on the event).

    Revoking a revoked key changes nothing and records nothing.
    """
    now = timezone.now()
    if ApiKey.objects.filter(id=key.id, revoked_at__isnull=True).update(revoked_at=now) == 1:
        key.revoked_at = now
        api_keys_changed(tenant_id=key.tenant_id, reason="revoked", key_id=key.id)
        audit_record(
            tenant=key.tenant,
            actor=by,
            action="api_key.revoke",
            target=f"api_key:{key.prefix}",
            before={"state": "active"},
            after={"state": "revoked"},
        )
    else:
        key.refresh_from_db(fields=["revoked_at"])
    return key


# Keys per UPDATE of api_keys_touch: keeps each statement (and its CASE) a reasonable size.
_TOUCH_CHUNK = 500


def key_touch_interval() -> timedelta:
    """How often one key's `last_used_at` may be written (MINT_KEY_TOUCH_INTERVAL_S)."""
    return timedelta(seconds=settings.MINT_KEY_TOUCH_INTERVAL_S)


def api_key_touch(*, key: ApiKey) -> None:
    """Record that a key was used now (a REST request), writing at most once per MINT_KEY_TOUCH_INTERVAL_S per key."""
    now = timezone.now()
    if touch_due(key.last_used_at, now, key_touch_interval()) and api_keys_touch(used={key.id: now}):
        key.last_used_at = now


def api_keys_touch(*, used: Mapping[int, datetime]) -> int:
    """Record when keys were last used (key id → time): the one writer of `ApiKey.last_used_at`.

    One UPDATE per 500 keys, so the gateway writes a whole interval of requests at once. A key written
    within MINT_KEY_TOUCH_INTERVAL_S (by this process or another) is left as it is. Returns how many keys
    were written.
    """
    ids = sorted(used)
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=timezone.now() - key_touch_interval())
    written = 0
    for start in range(0, len(ids), _TOUCH_CHUNK):
        chunk = ids[start : start + _TOUCH_CHUNK]
        value = Case(*(When(id=i, then=Value(used[i])) for i in chunk), output_field=DateTimeField())
        written += ApiKey.objects.filter(stale, id__in=chunk).update(last_used_at=value)
    return written


# What tenant_update may change: the plan limits, the switches and the display name. The slug is how people,
# pipelines (X-Mint-Tenant), sessions and the audit log name the tenant, so it never changes.
TENANT_UPDATABLE_FIELDS = (
    "name",
    "is_active",
    "four_eyes",
    "max_adapters",
    "max_ready_revisions",
    "max_live_aliases",
    "max_cold_wait_s",
    "max_held_requests",
    "rate_limit_rpm",
    "max_upload_bytes",
    "max_storage_bytes",
    "max_revisions",
    "max_concurrent_tasks",
    "api_read_rpm",
    "api_write_rpm",
    "api_tenant_write_rpm",
    "max_aliases_per_adapter",
    "max_replicas",
    "max_inflight_requests",
    "max_request_tokens",
    "max_choices",
    "max_logprobs",
    "max_structured_output_bytes",
    "max_tokens_per_minute",
    "monthly_token_budget",
    "max_api_keys",
    "max_evaluation_cases",
    "max_evaluation_tokens",
    "max_evaluation_requests",
    "max_webhook_endpoints",
    "retention_keep_last",
    "retention_grace_days",
)


@transaction.atomic
def tenant_update(*, tenant: Tenant, changes: dict[str, Any], by: Actor) -> Tenant:
    """Change a tenant's plan limits, four-eyes rule, active flag or name, and record it (`tenant.update`).

    The audit event's before/after hold only the fields whose value changes; a call that changes nothing
    records nothing. Values are checked as the model's fields check them. Returns the tenant as saved.
    """
    unknown = sorted(set(changes) - set(TENANT_UPDATABLE_FIELDS))
    if unknown:
        raise MintError(
            f"Tenant field(s) {', '.join(unknown)} cannot be changed; use {', '.join(TENANT_UPDATABLE_FIELDS)}.",
            code="invalid_field",
            detail={"fields": unknown},
        )
    current = Tenant.objects.select_for_update().get(pk=tenant.pk)
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    errors: dict[str, list[str]] = {}
    for name, raw in changes.items():
        try:
            value = Tenant._meta.get_field(name).clean(raw, current)
        except ValidationError as exc:
            errors[name] = exc.messages
            continue
        if getattr(current, name) != value:
            before[name], after[name] = getattr(current, name), value
            setattr(current, name, value)
    if errors:
        message = "; ".join(f"{name}: {' '.join(messages)}" for name, messages in errors.items())
        raise MintError(message, code="invalid_request", detail=errors)
    if after:
        current.save(update_fields=list(after))
        audit_record(
            tenant=current,
            actor=by,
            action="tenant.update",
            target=f"tenant:{current.slug}",
            before=before,
            after=after,
        )
    return current
