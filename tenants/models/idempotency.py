"""The answers the REST API keeps for requests sent with an `Idempotency-Key`."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models.keys import ApiKey
from tenants.models.tenant import Tenant


class IdempotencyRecord(models.Model):
    """A POST of the REST API sent with an `Idempotency-Key`: whose it was, what it asked, and the answer it got.

    Keyed by the caller's credential (`scope`: one API key, or one person in one tenant) and the key string, so
    nobody else's request ever finds it. Kept MINT_IDEMPOTENCY_TTL_S, then purged (tenants.tasks). The middleware
    that writes it is tenants/idempotency.py.
    """

    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", "In progress"
        COMPLETED = "completed", "Completed"

    scope = models.CharField(max_length=100, help_text="key:<api key id>, or user:<id>@tenant:<id or ->.")
    key = models.CharField(max_length=255)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    method = models.CharField(max_length=10)
    path = models.CharField(max_length=1000)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the request's body (its fields and files).")
    state = models.CharField(max_length=16, choices=State.choices, default=State.IN_PROGRESS)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    content_type = models.CharField(max_length=200, blank=True)
    response_body = models.BinaryField(null=True, blank=True, help_text="None: the answer was too large to keep.")
    created_at = models.DateTimeField(default=timezone.now)
    locked_until = models.DateTimeField(help_text="Until then a retry is told the first request still runs.")
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_scope_key_unique"),
            models.CheckConstraint(
                condition=models.Q(state__in=["in_progress", "completed"]), name="idempotency_state_valid"
            ),
        ]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_expiry")]

    def __str__(self) -> str:
        return f"{self.scope} {self.key!r} {self.state}"
