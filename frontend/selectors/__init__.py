"""Reads for the dashboard pages, one module per page. Every function takes the tenant, so nothing of another
tenant is ever loaded.

Each page's queries are fixed in number, whatever the number of rows (the view tests pin them).
"""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet

PAGE_SIZE = 50


def page(queryset: QuerySet, number: str | int | None, *, size: int = PAGE_SIZE) -> Page:
    return Paginator(queryset, size).get_page(number)
