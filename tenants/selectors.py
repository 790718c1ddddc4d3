"""Reads of tenants, members, keys and audit events. Every read of tenant data names the tenant."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from tenants.models import ApiKey, AuditEvent, Membership, Tenant


def api_key_by_prefix(*, prefix: str) -> ApiKey | None:
    return ApiKey.objects.select_related("tenant", "created_by").filter(prefix=prefix).first()


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
