"""Celery tasks of the tenants app (queue `control`)."""

from __future__ import annotations

from celery import shared_task

from tenants import idempotency


@shared_task(ignore_result=True)
def idempotency_purge() -> None:
    """Delete Idempotency-Key records past MINT_IDEMPOTENCY_TTL_S (beat, hourly)."""
    idempotency.idempotency_purge()
