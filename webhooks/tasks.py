"""Celery tasks of webhooks, on the control queue (the workers of `make run` and of the e2e world consume it)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from webhooks import services

# One attempt is bounded by MINT_WEBHOOK_TIMEOUT_S in the transport; these only catch a runaway around it.
_LIMITS = {
    "soft_time_limit": settings.MINT_WEBHOOK_TIMEOUT_S + 30,
    "time_limit": settings.MINT_WEBHOOK_TIMEOUT_S + 60,
}


@shared_task(acks_late=True, ignore_result=True, **_LIMITS)
def webhook_deliver(*, delivery_id: int) -> None:
    """Make the next attempt of one delivery (it queues the one after, with backoff, when it fails)."""
    services.delivery_attempt(delivery_id=delivery_id)


@shared_task(ignore_result=True)
def webhooks_sweep() -> None:
    """Beat: queue deliveries whose message was lost; delete those older than MINT_WEBHOOK_RETENTION_DAYS."""
    services.deliveries_sweep()
