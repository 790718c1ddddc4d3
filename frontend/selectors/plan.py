"""A tenant's plan as its owner sees it: each plan field, its value, and what the tenant uses of it now.

The Settings page and `GET /api/v1/tenant/` show the same rows, so a 429 that names a plan field
(`detail.quota`) names a row the owner can read. Per-request bounds (largest upload, max_tokens of one
request…) have no use to show; limits counted per minute show what was counted, where it is stored.
The fields are the plan's as `tenants.services.TENANT_UPDATABLE_FIELDS` lists them (its one home).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Sum
from django.utils import timezone

from adapters.models import Adapter, BaseModel
from serving.models import BILLED_KINDS, Alias, UsagePeriod, UsageRecord
from serving.services import capacity as serving_capacity
from serving.services.budgets import usage_month_tokens
from tenants.models import ApiKey, Tenant
from tenants.services import TENANT_UPDATABLE_FIELDS
from webhooks.models import WebhookEndpoint

# Not limits: the tenant's name and switches are shown apart (is_active, four_eyes).
NOT_LIMITS = ("name", "is_active", "four_eyes")
PLAN_FIELDS = tuple(name for name in TENANT_UPDATABLE_FIELDS if name not in NOT_LIMITS)
# Fields whose 0 means "no limit".
ZERO_IS_UNLIMITED = ("max_tokens_per_minute", "monthly_token_budget")
BYTE_FIELDS = ("max_upload_bytes", "max_storage_bytes")


@dataclass(frozen=True)
class PlanRow:
    """One plan field: its value, what is used of it now (None: a bound on each request, nothing to count), and
    per-item uses where the limit applies to each of several things (per base model, per adapter)."""

    field: str
    label: str
    help: str
    limit: int
    used: int | None = None
    per: dict[str, int] | None = None
    unit: str = ""

    @property
    def unlimited(self) -> bool:
        return self.field in ZERO_IS_UNLIMITED and self.limit == 0

    @property
    def full(self) -> bool:
        """At or over the limit: the next request it counts will be refused (429)."""
        if self.unlimited:
            return False
        counted = [self.used] if self.used is not None else []
        counted += list((self.per or {}).values())
        return any(value >= self.limit for value in counted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "label": self.label,
            "help": self.help,
            "limit": self.limit,
            "unlimited": self.unlimited,
            "used": self.used,
            "per": self.per,
            "unit": self.unit,
            "full": self.full,
        }


def _pinned(tenant: Tenant) -> dict[str, int]:
    bases = BaseModel.objects.filter(adapters__tenant=tenant).distinct().values_list("id", "name")
    return {
        name: len(serving_capacity.pinned_now(tenant_id=tenant.id, base_model_id=base_id))
        for base_id, name in sorted(bases, key=lambda row: row[1])
    }


def _aliases(tenant: Tenant) -> dict[str, int]:
    """Aliases of each of the tenant's adapters that has any, the fullest first (at most 20 shown)."""
    rows = (
        Alias.objects.filter(adapter__tenant=tenant)
        .values_list("adapter__name")
        .annotate(n=Count("id"))
        .order_by("-n", "adapter__name")[:20]
    )
    return dict(rows)


def _month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _next_month(start: datetime) -> datetime:
    return (start + timedelta(days=32)).replace(day=1)


def _tokens_last_minute(tenant: Tenant, now: datetime) -> int:
    """Tokens of the tenant's billed traffic (what counts against max_tokens_per_minute: inference, sampling,
    evaluations) in the last whole minute, as metered (what the nodes reported)."""
    minute = now.replace(second=0, microsecond=0) - timedelta(minutes=1)
    rows = UsageRecord.objects.filter(
        tenant=tenant, period=UsagePeriod.MINUTE, kind__in=BILLED_KINDS, start=minute
    ).aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return int((rows["prompt"] or 0) + (rows["completion"] or 0))


def _uses(tenant: Tenant, now: datetime) -> dict[str, Callable[[], tuple[int | None, dict[str, int] | None]]]:
    start = _month_start(now)
    return {
        "max_adapters": lambda: (Adapter.objects.filter(tenant=tenant).count(), None),
        "max_ready_revisions": lambda: (None, _pinned(tenant)),
        "max_storage_bytes": lambda: (tenant.stored_bytes, None),
        "max_revisions": lambda: (tenant.stored_revisions, None),
        "max_aliases_per_adapter": lambda: (None, _aliases(tenant)),
        "max_api_keys": lambda: (
            ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).exclude(expires_at__lte=now).count(),
            None,
        ),
        "max_webhook_endpoints": lambda: (WebhookEndpoint.objects.filter(tenant=tenant).count(), None),
        "monthly_token_budget": lambda: (
            usage_month_tokens(tenant_id=tenant.id, start=start, end=_next_month(start)),
            None,
        ),
        "max_tokens_per_minute": lambda: (_tokens_last_minute(tenant, now), None),
    }


def plan_rows(*, tenant: Tenant) -> list[PlanRow]:
    """Every plan field of the tenant, in the plan's order, with its use where one is counted."""
    current = Tenant.objects.get(id=tenant.id)  # the stored counters as they are now, not as the request loaded
    now = timezone.now()
    uses = _uses(current, now)
    rows = []
    for name in PLAN_FIELDS:
        model_field = Tenant._meta.get_field(name)
        used, per = uses[name]() if name in uses else (None, None)
        rows.append(
            PlanRow(
                field=name,
                label=str(model_field.verbose_name).capitalize(),
                help=str(model_field.help_text),
                limit=int(getattr(current, name)),
                used=used,
                per=per,
                unit="bytes" if name in BYTE_FIELDS else "",
            )
        )
    return rows
