"""API keys: what a tenant's programs sign in with, and the scopes a key holds."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models.tenant import Tenant


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (OpenAI-compatible gateway)"
    PIPELINE = "pipeline", "Pipeline (register revisions, read the catalog, sample them)"
    DEPLOY = "deploy", "Deploy (approve, activate, roll back)"
    # A rollout worker's key: samples any exported revision by `adapter@rN`, and nothing else.
    SAMPLING = "sampling", "Sampling (sample any exported revision as adapter@rN, approved or not)"


class ApiKey(models.Model):
    """A tenant's API key. The token `mint_<prefix>_<secret>` is shown once; only SHA-256(secret) is kept."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Limits of the key's own, within its tenant's (both apply): set when the key is made, never changed after.
    adapters = models.JSONField(
        default=list,
        blank=True,
        help_text="Names of the adapters the key may call through the gateway; empty: all of the tenant's.",
    )
    max_tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Gateway tokens per minute of this key; empty: only the tenant's limit."
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Gateway tokens per calendar month (UTC) of this key; empty: only the tenant's.",
    )

    class Meta:
        indexes = [models.Index(fields=["tenant", "-id"], name="apikey_tenant_recent")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(max_tokens_per_minute__isnull=True) | models.Q(max_tokens_per_minute__gte=1),
                name="apikey_max_tokens_per_minute_min",
            ),
            models.CheckConstraint(
                condition=models.Q(monthly_token_budget__isnull=True) | models.Q(monthly_token_budget__gte=1),
                name="apikey_monthly_token_budget_min",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name} (mint_{self.prefix}_…)"

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"
