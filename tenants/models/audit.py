"""The audit log a tenant's changes are recorded in."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models.keys import ApiKey
from tenants.models.tenant import Tenant


class AuditEvent(models.Model):
    """An append-only record of a change: who (a person or a key) did what to which object, before and after.

    Rows outlive their tenant: deleting a tenant clears `tenant` and keeps `tenant_slug`.
    """

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events")
    tenant_slug = models.SlugField(max_length=63, blank=True, help_text="The tenant's slug at the time of the event.")
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.CharField(max_length=200, help_text="Who acted, as shown to people.")
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="audit_tenant_recent"),
            models.Index(fields=["tenant", "action", "-id"], name="audit_tenant_action"),
            # A member's last change in a tenant (the members list's last activity).
            models.Index(fields=["tenant", "actor_user", "-id"], name="audit_tenant_actor"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
