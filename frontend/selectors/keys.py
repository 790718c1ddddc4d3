"""The API keys page."""

from __future__ import annotations

from django.core.paginator import Page
from django.db.models import QuerySet

from frontend.selectors import page
from tenants import selectors as tenant_selectors
from tenants.models import ApiKey, Tenant


def api_key_page(*, tenant: Tenant, number: str | int | None = None) -> Page:
    keys: QuerySet[ApiKey] = tenant_selectors.api_key_list(tenant=tenant).order_by("-id")
    return page(keys, number)


def api_key_get(*, tenant: Tenant, prefix: str) -> ApiKey | None:
    return tenant_selectors.api_key_list(tenant=tenant).select_related("tenant").filter(prefix=prefix).first()
