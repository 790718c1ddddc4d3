"""Reads of tenants, members, keys and audit events. Every read of tenant data names the tenant."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import OuterRef, QuerySet, Subquery

from tenants.models import ApiKey, AuditEvent, Membership, Tenant


def api_key_by_prefix(*, prefix: str) -> ApiKey | None:
    """The key with this prefix, with its tenant, its creator and `creator_role` (the creator's role in the
    key's tenant now, None if they are not a member), in one query: every authenticated request runs it."""
    creator_role = Membership.objects.filter(user=OuterRef("created_by"), tenant=OuterRef("tenant")).values("role")
    return (
        ApiKey.objects.select_related("tenant", "created_by")
        .annotate(creator_role=Subquery(creator_role[:1]))
        .filter(prefix=prefix)
        .first()
    )


def api_keys_live_created_by(*, user: AbstractBaseUser) -> QuerySet[ApiKey]:
    """The keys a person created that are not revoked (in every tenant)."""
    return ApiKey.objects.filter(created_by=user, revoked_at__isnull=True).select_related("tenant")


def tenant_ids_of_person(*, user: AbstractBaseUser) -> set[int]:
    """The tenants a person belongs to or holds keys in: where a change to the person changes what keys may do."""
    member_of = Membership.objects.filter(user=user).values_list("tenant_id", flat=True)
    keys_in = ApiKey.objects.filter(created_by=user).values_list("tenant_id", flat=True)
    return set(member_of.union(keys_in))


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by")


def memberships_of(*, user: AbstractBaseUser) -> list[Membership]:
    return list(
        Membership.objects.filter(user=user, tenant__is_active=True).select_related("tenant").order_by("tenant__slug")
    )


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")


def audit_event_list(*, tenant: Tenant, action: str | None = None, target: str | None = None) -> QuerySet[AuditEvent]:
    events = AuditEvent.objects.filter(tenant=tenant)
    if action:
        events = events.filter(action=action)
    if target:
        events = events.filter(target=target)
    return events
