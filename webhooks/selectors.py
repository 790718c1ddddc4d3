"""Reads of webhooks. Every function takes the tenant, so nothing of another tenant is ever loaded."""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet

from tenants.models import Tenant
from webhooks.models import WebhookDelivery, WebhookEndpoint


def endpoint_list(*, tenant: Tenant) -> QuerySet[WebhookEndpoint]:
    return WebhookEndpoint.objects.filter(tenant=tenant).select_related("created_by").order_by("-id")


def endpoint_get(*, tenant: Tenant, endpoint_id: int) -> WebhookEndpoint | None:
    return WebhookEndpoint.objects.filter(tenant=tenant, id=endpoint_id).select_related("tenant").first()


def delivery_list(*, tenant: Tenant, endpoint: WebhookEndpoint | None = None) -> QuerySet[WebhookDelivery]:
    """Deliveries of the tenant's endpoints (or of one), newest first."""
    rows = WebhookDelivery.objects.filter(endpoint__tenant=tenant)
    if endpoint is not None:
        rows = rows.filter(endpoint=endpoint)
    return rows.select_related("endpoint", "redelivery_of").order_by("-id")


def delivery_get(*, tenant: Tenant, endpoint_id: int, delivery_id: int) -> WebhookDelivery | None:
    return (
        WebhookDelivery.objects.filter(endpoint__tenant=tenant, endpoint_id=endpoint_id, id=delivery_id)
        .select_related("endpoint__tenant")
        .first()
    )


def delivery_page(*, tenant: Tenant, number: str | int | None, per_page: int = 50) -> Page:
    """One page of the tenant's recent deliveries, for the dashboard."""
    return Paginator(delivery_list(tenant=tenant), per_page).get_page(number)
