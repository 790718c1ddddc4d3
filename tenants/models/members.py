"""Who belongs to a tenant and with which role: memberships and the invitations that make them."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models.tenant import Tenant


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    APPROVER = "approver", "Approver"
    DEVELOPER = "developer", "Developer"
    VIEWER = "viewer", "Viewer"


class Membership(models.Model):
    """A person's role in one tenant. People may belong to several tenants."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique"),
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="membership_role_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


class Invitation(models.Model):
    """An owner's invitation for a person to join a tenant with a role (tenants/members.py).

    Addressed to an email address (a person who may have no account yet: they choose a username and a password
    when they accept) or to an existing account (`user`, invited by username). The link mailed to the address
    is signed; it works once, until `expires_at`, and not after the invitation was revoked.
    """

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        ACCEPTED = "accepted", "Accepted"
        REVOKED = "revoked", "Revoked"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField(help_text="Where the link was mailed.")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="The account invited by username; empty for an invitation by email.",
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    # Part of the signed link, so a link stops working when its invitation is sent again (a new nonce).
    nonce = models.CharField(max_length=32, editable=False)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True, help_text="When it was accepted or revoked.")

    class Meta:
        indexes = [models.Index(fields=["tenant", "state"], name="invitation_tenant_state")]
        constraints = [
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="invitation_role_valid"),
            models.CheckConstraint(
                condition=models.Q(state__in=["pending", "accepted", "revoked"]), name="invitation_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"invitation of {self.email} to {self.tenant} as {self.role} ({self.state})"

    @property
    def expired(self) -> bool:
        return self.state == self.State.PENDING and self.expires_at <= timezone.now()
