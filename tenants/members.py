"""Writes of a tenant's people beyond `membership_set`/`membership_remove` (tenants/services.py): invitations
(sent by mail, accepted by their signed link, revoked), role changes of members only, and ownership transfer.

An owner acts alone: nobody else has to step in for a colleague to join. Each change is audited in its
transaction and announced once committed (`services.member_event`: the members page, and `member.*` webhooks).
A tenant always keeps an owner: the last one can neither leave nor be demoted (`services.membership_set`).
"""

from __future__ import annotations

import logging
import secrets
import smtplib
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, BaseUserManager
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import transaction
from django.template.loader import render_to_string
from django.utils import timezone
from rest_framework import status

from mint_site.errors import Conflict, MintError, NotFound, QuotaExceeded
from tenants import invitation_links, services
from tenants.access import Actor
from tenants.models import IdentityProvider, Invitation, Membership, Role, Tenant

log = logging.getLogger(__name__)

EMAIL_MAX_LENGTH = 254


class MailFailed(MintError):
    """The mail server refused or could not be reached: nothing was sent, and nothing was kept."""

    status_code = status.HTTP_502_BAD_GATEWAY
    code = "mail_failed"


def _clean_role(role: str) -> str:
    if role not in Role.values:
        raise MintError(
            f"Unknown role {role!r}; use one of {', '.join(Role.values)}.",
            code="invalid_role",
            detail={"role": [f"one of {', '.join(Role.values)}"]},
        )
    return role


def _clean_email(email: str) -> str:
    email = BaseUserManager.normalize_email((email or "").strip())
    try:
        if len(email) > EMAIL_MAX_LENGTH:
            raise ValidationError("too long")
        validate_email(email)
    except ValidationError:
        raise MintError(
            f"email: {email[:80]!r} is not an email address.",
            code="invalid_email",
            detail={"email": ["not an email address"]},
        ) from None
    return email


def _invitee(*, email: str, username: str) -> tuple[str, AbstractBaseUser | None]:
    """The address to mail and the account invited (None: a person who may have no account yet)."""
    if bool(email) == bool(username):
        raise MintError(
            "Invite a person by email or by username: give exactly one of them.",
            code="invalid_request",
            detail={"email": ["give email or username"], "username": ["give email or username"]},
        )
    if email:
        return _clean_email(email), None
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None or not user.email:
        # One answer for both, so that inviting is no way to learn which accounts exist.
        raise MintError(
            f"No account named {username[:150]!r} can be invited by username (there is none, or it has no email "
            "address to send the link to); invite the person by email instead.",
            code="unknown_user",
            detail={"username": ["no account to invite by username"]},
        )
    return user.email, user


def _check_pending_quota(tenant: Tenant) -> None:
    """At most MINT_MAX_PENDING_INVITATIONS pending at once; the tenant's row lock serialises the count."""
    limit = settings.MINT_MAX_PENDING_INVITATIONS
    pending = Invitation.objects.filter(
        tenant=tenant, state=Invitation.State.PENDING, expires_at__gt=timezone.now()
    ).count()
    if pending >= limit:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} has {pending} pending invitations, the most it may have at once "
            f"(MINT_MAX_PENDING_INVITATIONS={limit}); revoke one or wait for them to be accepted or expire.",
            code="invitation_quota_exceeded",
            detail={"quota": "MINT_MAX_PENDING_INVITATIONS", "limit": limit, "used": pending},
        )


def member_invite(
    *,
    tenant: Tenant,
    role: str,
    by: Actor,
    site_url: str,
    email: str = "",
    username: str = "",
) -> Invitation:
    """Invite a person into `tenant` with `role` and mail them the signed link (`site_url` + its path).

    By `email` (the person may have no account: they choose a username and password when they accept) or by
    `username` (an existing account with an email address; only that account can accept). Inviting the same
    person again while an invitation is pending sends it again, with the new role and a new expiry; the old
    link stops working. Mail that cannot be sent refuses the whole invitation (502 `mail_failed`).
    """
    role = _clean_role(role)
    address, user = _invitee(email=email, username=username)
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().get(id=tenant.id)
        members = Membership.objects.filter(tenant=locked)
        already = members.filter(user=user) if user is not None else members.filter(user__email__iexact=address)
        if already.exists():
            raise Conflict(
                f"{username or address} is already a member of {locked.slug}; change their role instead.",
                code="already_member",
            )
        pending = Invitation.objects.select_for_update().filter(tenant=locked, state=Invitation.State.PENDING)
        invitation = (pending.filter(user=user) if user is not None else pending.filter(email__iexact=address)).first()
        if invitation is None:
            _check_pending_quota(locked)
            invitation = Invitation(tenant=locked, email=address, user=user)
        invitation.role = role
        invitation.nonce = secrets.token_hex(16)
        invitation.invited_by = by.person
        invitation.expires_at = timezone.now() + timedelta(seconds=settings.MINT_INVITATION_TTL_S)
        invitation.save()
        services.audit_record(
            tenant=locked,
            actor=by,
            action="member.invite",
            target=f"invitation:{address}",
            after={"email": address, "username": user.get_username() if user else None, "role": role},
        )
        services.member_event(
            tenant_id=locked.id,
            state="invited",
            member=user.get_username() if user else address,
            role=role,
            by=by,
            id=invitation.id,
        )
        # Sent inside the transaction: mail that fails leaves no invitation behind, and the owner is told.
        _mail_invitation(invitation, site_url=site_url, by=by)
    return invitation


def _mail_invitation(invitation: Invitation, *, site_url: str, by: Actor) -> None:
    link = f"{site_url.rstrip('/')}{invitation_links.path_of(invitation)}"
    context = {
        "invitation": invitation,
        "tenant": invitation.tenant,
        "link": link,
        "inviter": by.label,
        "expires_at": invitation.expires_at,
    }
    subject = f"You are invited to {invitation.tenant.name} on MinT"
    body = render_to_string("tenants/mail/invitation.txt", context)
    try:
        send_mail(subject, body, None, [invitation.email])
    except (smtplib.SMTPException, OSError) as exc:
        log.warning("invitation mail to %s not sent: %s", invitation.email, exc)
        raise MailFailed(
            f"The invitation mail to {invitation.email} could not be sent ({type(exc).__name__}); nothing was "
            "changed. Check the mail settings (EMAIL_HOST, EMAIL_PORT) and try again.",
        ) from None


@transaction.atomic
def invitation_revoke(*, invitation: Invitation, by: Actor) -> Invitation:
    """Revoke a pending invitation: its link stops working. Revoking one that is not pending is a 409."""
    now = timezone.now()
    if (
        Invitation.objects.filter(id=invitation.id, state=Invitation.State.PENDING).update(
            state=Invitation.State.REVOKED, decided_at=now
        )
        != 1
    ):
        invitation.refresh_from_db(fields=["state"])
        raise Conflict(f"This invitation is {invitation.state}, not pending.", code="invitation_not_pending")
    invitation.state, invitation.decided_at = Invitation.State.REVOKED, now
    services.audit_record(
        tenant=invitation.tenant,
        actor=by,
        action="member.invitation_revoke",
        target=f"invitation:{invitation.email}",
        before={"state": "pending", "role": invitation.role},
        after={"state": "revoked"},
    )
    services.member_event(
        tenant_id=invitation.tenant_id,
        state="invitation_revoked",
        member=invitation.user.get_username() if invitation.user_id else invitation.email,
        role=invitation.role,
        by=by,
        id=invitation.id,
    )
    return invitation


def invitation_problem(invitation: Invitation, *, user: AbstractBaseUser | None) -> str | None:
    """Why `user` (None: someone without an account) cannot accept `invitation` now, or None if they can."""
    if invitation.state != Invitation.State.PENDING:
        return f"This invitation was {invitation.state} already."
    if invitation.expires_at <= timezone.now():
        return "This invitation has expired; ask an owner of the tenant to invite you again."
    if not invitation.tenant.is_active:
        return f"Tenant {invitation.tenant.slug} is suspended."
    if user is None:
        if invitation.user_id is not None or account_for_email(invitation.email) is not None:
            return "An account with this address exists: sign in to accept."
        return None
    if invitation.user_id is not None:
        if invitation.user_id != user.pk:
            return (
                f"This invitation is for {invitation.user.get_username()}; you are signed in as "
                f"{user.get_username()}. Sign out and sign in as {invitation.user.get_username()} to accept it."
            )
        return None
    if (user.email or "").lower() != invitation.email.lower():
        return (
            f"This invitation was sent to {invitation.email}; your account ({user.get_username()}) has another "
            "address. Sign in with the account of that address, or ask the owner to invite you by username."
        )
    return None


def account_for_email(email: str) -> AbstractBaseUser | None:
    """The one active account with this address, if exactly one has it."""
    users = list(get_user_model().objects.filter(email__iexact=email, is_active=True)[:2])
    return users[0] if len(users) == 1 else None


@transaction.atomic
def invitation_accept(*, invitation: Invitation, user: AbstractBaseUser) -> Membership:
    """`user` accepts `invitation`: they become a member with its role (the link works once).

    A person who was a member already (they joined another way meanwhile) gets the invitation's role.
    """
    locked = Invitation.objects.select_for_update(of=("self",)).select_related("tenant", "user").get(id=invitation.id)
    problem = invitation_problem(locked, user=user)
    if problem is not None:
        raise Conflict(problem, code="invitation_not_usable")
    locked.state, locked.accepted_by, locked.decided_at = Invitation.State.ACCEPTED, user, timezone.now()
    locked.save(update_fields=["state", "accepted_by", "decided_at"])
    actor = Actor(user=user)
    services.audit_record(
        tenant=locked.tenant,
        actor=actor,
        action="member.invitation_accept",
        target=f"invitation:{locked.email}",
        before={"state": "pending"},
        after={"state": "accepted", "username": user.get_username(), "role": locked.role},
    )
    return services.membership_set(tenant=locked.tenant, user=user, role=locked.role, by=actor)


@transaction.atomic
def invitation_accept_new_account(*, invitation: Invitation, username: str, password: str) -> AbstractBaseUser:
    """A person without an account accepts: an account (`username`, `password`, the invitation's address) is
    made and joins the tenant. The caller has validated the password (Django's validators)."""
    model = get_user_model()
    if model.objects.filter(username__iexact=username).exists():
        raise Conflict(f"The username {username!r} is taken; choose another.", code="username_taken")
    problem = invitation_problem(invitation, user=None)
    if problem is not None:
        raise Conflict(problem, code="invitation_not_usable")
    user = model.objects.create_user(username=username, email=invitation.email, password=password)
    invitation_accept(invitation=invitation, user=user)
    return user


def member_role_change(*, tenant: Tenant, user: AbstractBaseUser, role: str, by: Actor) -> Membership:
    """Change a member's role (404 for someone who is not a member). The last owner cannot be demoted (409)."""
    role = _clean_role(role)
    if not Membership.objects.filter(tenant=tenant, user=user).exists():
        raise NotFound(f"{user.get_username()} is not a member of {tenant.slug}.", code="not_a_member")
    return services.membership_set(tenant=tenant, user=user, role=role, by=by)


@transaction.atomic
def ownership_transfer(
    *, tenant: Tenant, to: AbstractBaseUser, by: Actor, previous_role: str = Role.APPROVER
) -> Membership:
    """Hand the tenant to another member: they become owner, and the person transferring it takes
    `previous_role` (approver unless said otherwise). Other owners stay owners."""
    previous_role = _clean_role(previous_role)
    giver = by.person
    if giver is None:
        raise MintError("Only a person can transfer ownership.", code="invalid_request")
    if to.pk == giver.pk:
        raise MintError("You own this tenant already; name another member.", code="invalid_request")
    if not Membership.objects.filter(tenant=tenant, user=to).exists():
        raise NotFound(f"{to.get_username()} is not a member of {tenant.slug}.", code="not_a_member")
    membership = services.membership_set(tenant=tenant, user=to, role=Role.OWNER, by=by)
    services.membership_set(tenant=tenant, user=giver, role=previous_role, by=by)
    services.audit_record(
        tenant=tenant,
        actor=by,
        action="member.ownership_transfer",
        target=f"member:{to.get_username()}",
        before={"owner": giver.get_username()},
        after={"owner": to.get_username(), "previous_owner_role": previous_role},
    )
    return membership


SSO_JOIN_CHOICES = ("invitation", "default_role")
SSO_DEFAULT_ROLES = (Role.APPROVER, Role.DEVELOPER, Role.VIEWER)
_UNSET = object()


@transaction.atomic
def tenant_sso_update(
    *,
    tenant: Tenant,
    by: Actor,
    provider: IdentityProvider | object | None = _UNSET,
    join: str | None = None,
    default_role: str | None = None,
) -> Tenant:
    """Bind the tenant to an identity provider (staff: the registration holds a secret), or change who joins
    through it (`join`: invitation or default_role) and with which role (never owner). Audited as `tenant.sso`
    with what changed; a call that changes nothing records nothing."""
    current = Tenant.objects.select_for_update().get(id=tenant.id)
    wanted: dict[str, Any] = {}
    if provider is not _UNSET:
        wanted["sso_provider_id"] = provider.id if provider is not None else None
    if join is not None:
        if join not in SSO_JOIN_CHOICES:
            raise MintError(
                f"sso_join must be one of {', '.join(SSO_JOIN_CHOICES)}.", detail={"sso_join": ["unknown choice"]}
            )
        wanted["sso_join"] = join
    if default_role is not None:
        if default_role not in SSO_DEFAULT_ROLES:
            raise MintError(
                f"sso_default_role must be one of {', '.join(SSO_DEFAULT_ROLES)} (owners are made by invitation).",
                detail={"sso_default_role": ["unknown or not allowed"]},
            )
        wanted["sso_default_role"] = default_role
    changed = {name: value for name, value in wanted.items() if getattr(current, name) != value}
    if not changed:
        return current
    before = {name: getattr(current, name) for name in changed}
    for name, value in changed.items():
        setattr(current, name, value)
    current.save(update_fields=[name.removesuffix("_id") for name in changed])
    services.audit_record(
        tenant=current, actor=by, action="tenant.sso", target=f"tenant:{current.slug}", before=before, after=changed
    )
    return current
