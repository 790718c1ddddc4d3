"""The audit log page and its CSV export."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta

from django.core.paginator import Page
from django.db.models import QuerySet

from frontend.selectors import page
from tenants import selectors as tenant_selectors
from tenants.models import AuditEvent, Tenant

AUDIT_EXPORT_MAX_ROWS = 50_000  # one CSV export at most; the page says so, and a narrower date range gets the rest


def audit_events(
    *,
    tenant: Tenant,
    action: str = "",
    target: str = "",
    actor: str = "",
    since: date | None = None,
    until: date | None = None,
) -> QuerySet[AuditEvent]:
    """The tenant's audit events matching the filters, newest first; `since`/`until` are UTC days, both included."""
    events: QuerySet[AuditEvent] = tenant_selectors.audit_event_list(tenant=tenant, action=action or None)
    if target:
        events = events.filter(target__icontains=target)
    if actor:
        events = events.filter(actor__icontains=actor)
    if since:
        events = events.filter(at__gte=datetime.combine(since, time.min, tzinfo=UTC))
    if until and until < date.max:  # the last representable day bounds nothing (and has no day after it)
        events = events.filter(at__lt=datetime.combine(until + timedelta(days=1), time.min, tzinfo=UTC))
    return events.order_by("-id")


def audit_page(*, tenant: Tenant, number: str | int | None = None, **filters) -> Page:
    """A page of the tenant's audit log, newest first (2 queries: count and rows)."""
    return page(audit_events(tenant=tenant, **filters), number)


def audit_export_rows(*, tenant: Tenant, **filters) -> Iterator[AuditEvent]:
    """The tenant's matching audit events for a CSV export, newest first, at most AUDIT_EXPORT_MAX_ROWS,
    read from the database in chunks (the export streams them)."""
    events = audit_events(tenant=tenant, **filters)[:AUDIT_EXPORT_MAX_ROWS]
    return events.iterator(chunk_size=2000)


def audit_actions(*, tenant: Tenant) -> list[str]:
    return list(AuditEvent.objects.filter(tenant=tenant).order_by("action").values_list("action", flat=True).distinct())
