"""Webhook endpoints of a tenant, the deliveries made to them, and the sequence counters of their subjects."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.models import Tenant

# The lifecycle events an endpoint may subscribe to (`events`; empty: all of them). `ping` is sent by hand only.
WEBHOOK_EVENTS = (
    "revision.validated",
    "revision.failed",
    "revision.exported",
    "revision.approved",
    "revision.rejected",
    "evaluation.finished",
    "alias.flipped",
    "canary.started",
    "canary.promoted",
    "canary.aborted",
    "placement.failed",
    # Retiring (serving/services/retire.py, retention): `data` names the adapter, and the revision or alias.
    "revision.archived",
    "revision.restored",
    "alias.deactivated",
    "adapter.deleted",
    # A tenant's people (tenants/members.py): `data` names the member (username, or the address invited), the
    # role (none once removed) and who made the change.
    "member.invited",
    "member.invitation_revoked",
    "member.joined",
    "member.role_changed",
    "member.removed",
)
PING = "ping"
URL_MAX_LENGTH = 2000


class WebhookEndpoint(models.Model):
    """A URL of a tenant that MinT POSTs signed lifecycle events to.

    `secret` signs every delivery (HMAC-SHA256); it is shown once, in the create response, and kept so that
    deliveries can be signed: it is a signing key, not a password, and no list, log or audit event shows it.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="webhook_endpoints")
    url = models.CharField(max_length=URL_MAX_LENGTH)
    description = models.CharField(max_length=200, blank=True)
    secret = models.CharField(max_length=100, editable=False)
    events = models.JSONField(default=list, blank=True, help_text="Event types sent here; empty: all of them.")
    is_active = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["tenant", "is_active"], name="webhook_endpoint_tenant")]

    def __str__(self) -> str:
        return f"webhook:{self.id} {self.url[:80]}"

    def wants(self, event: str) -> bool:
        return not self.events or event in self.events


class DeliveryState(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"


class WebhookDelivery(models.Model):
    """One event on its way to one endpoint: its signed body, and how each attempt went.

    `uid` is the `X-Mint-Delivery` header (new for a redelivery); `payload["id"]` names the event and stays the
    same across redeliveries, so a receiver can drop what it has seen. `next_attempt_at` is when the next attempt
    is due; while one runs it is pushed past the attempt's time limit, so that no second worker takes it.
    """

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    event = models.CharField(max_length=64)
    subject = models.CharField(max_length=200, blank=True)
    sequence = models.PositiveBigIntegerField(default=0)
    payload = models.JSONField()
    state = models.CharField(max_length=10, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    redelivery_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(state__in=DeliveryState.values), name="webhook_delivery_state_valid"),
        ]
        indexes = [
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
            models.Index(
                fields=["next_attempt_at"], name="webhook_delivery_due", condition=Q(state=DeliveryState.PENDING)
            ),
            models.Index(fields=["created_at"], name="webhook_delivery_created"),
        ]

    def __str__(self) -> str:
        return f"{self.event} → webhook:{self.endpoint_id} ({self.state})"


class WebhookSequence(models.Model):
    """The last sequence number given to an event of one subject of a tenant (e.g. `adapter:support-bot:r7`)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    subject = models.CharField(max_length=200)
    last = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "subject"], name="webhook_sequence_subject")]

    def __str__(self) -> str:
        return f"{self.subject} #{self.last}"
