"""Reads of tenants, members, keys and audit events. Every read of tenant data names the tenant."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone

from tenants.models import ApiKey, AuditEvent, Invitation, Membership, Tenant


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


def api_key_prefixes_known(*, prefixes: set[str]) -> set[str]:
    """Which of these prefixes name a key (revoked or not), in one query."""
    if not prefixes:
        return set()
    return set(ApiKey.objects.filter(prefix__in=prefixes).values_list("prefix", flat=True))


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


@dataclass(frozen=True)
class TenantChoice:
    """Which of a person's tenants a request acts for, and why none when none (`problem`)."""

    memberships: list[Membership]
    membership: Membership | None
    named: str | None

    @property
    def problem(self) -> str | None:
        """None when a tenant was chosen, else `not_member` (named one that is not theirs, or that does not
        exist: the same answer), `no_tenant` (a member of none) or `ambiguous` (several, none named)."""
        if self.membership is not None:
            return None
        if self.named:
            return "not_member"
        return "no_tenant" if not self.memberships else "ambiguous"


def choose_tenant(*, user: AbstractBaseUser, named: str | None) -> TenantChoice:
    """The one rule for the tenant a person's request acts for, on the REST API, the dashboard and its socket.

    The tenant named explicitly (REST `X-Mint-Tenant`, the dashboard's switcher kept in the session, the
    socket's `?tenant=`), else the person's only tenant, else none: each surface answers `problem` its way
    (REST 400/403/404, the dashboard its tenant chooser, the socket refuses). Suspended tenants don't count.
    """
    memberships = memberships_of(user=user)
    if named:
        chosen = next((m for m in memberships if m.tenant.slug == named), None)
    else:
        chosen = memberships[0] if len(memberships) == 1 else None
    return TenantChoice(memberships=memberships, membership=chosen, named=named or None)


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")


def member_list(*, tenant: Tenant, username: str | None = None) -> list[Membership]:
    """The tenant's members with their user, by username, each with `last_activity`: the latest of their last
    sign-in, the last use of a key they made in this tenant, and their last audited change here (None: never).
    One query, whatever the number of members. `username`: that member only (an empty list if not one)."""
    key_used = (
        ApiKey.objects.filter(tenant=OuterRef("tenant"), created_by=OuterRef("user"), last_used_at__isnull=False)
        .order_by("-last_used_at")
        .values("last_used_at")[:1]
    )
    acted = AuditEvent.objects.filter(tenant=OuterRef("tenant"), actor_user=OuterRef("user")).order_by("-id")
    rows = membership_list(tenant=tenant).annotate(
        key_used_at=Subquery(key_used), acted_at=Subquery(acted.values("at")[:1])
    )
    members = list(rows.filter(user__username=username) if username is not None else rows)
    for membership in members:
        moments = [m for m in (membership.user.last_login, membership.key_used_at, membership.acted_at) if m]
        membership.last_activity = max(moments) if moments else None
    return members


def member_get(*, tenant: Tenant, username: str) -> Membership | None:
    """A member of the tenant by username; None for a person who is not one (whether or not they exist)."""
    return Membership.objects.select_related("user", "tenant").filter(tenant=tenant, user__username=username).first()


def invitation_list(*, tenant: Tenant, pending_only: bool = True) -> QuerySet[Invitation]:
    """The tenant's invitations, newest first; by default those still pending and not expired."""
    invitations = Invitation.objects.filter(tenant=tenant).select_related("user", "invited_by").order_by("-id")
    if pending_only:
        invitations = invitations.filter(state=Invitation.State.PENDING, expires_at__gt=timezone.now())
    return invitations


def audit_event_list(*, tenant: Tenant, action: str | None = None, target: str | None = None) -> QuerySet[AuditEvent]:
    events = AuditEvent.objects.filter(tenant=tenant)
    if action:
        events = events.filter(action=action)
    if target:
        events = events.filter(target=target)
    return events
