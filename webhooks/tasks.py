"""Celery tasks of webhooks. Deliveries run on a queue of their own, `webhooks`, taken by a worker pool of their own
(`make run` starts one: devtools/launcher.py), so that receivers that answer slowly or never hold those threads
only, never the control workers every tenant's validation and export need. The sweep stays on `control`."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from webhooks import services

# One attempt is bounded by MINT_WEBHOOK_TIMEOUT_S in the transport; these only catch a runaway around it.
_LIMITS = {
    "soft_time_limit": settings.MINT_WEBHOOK_TIMEOUT_S + 30,
    "time_limit": settings.MINT_WEBHOOK_TIMEOUT_S + 60,
}


# The queue of deliveries (and the name its workers take: `celery worker -Q webhooks`).
WEBHOOK_QUEUE = "webhooks"


@shared_task(acks_late=True, ignore_result=True, queue=WEBHOOK_QUEUE, **_LIMITS)
def webhook_deliver(*, delivery_id: int) -> None:
    """Make the next attempt of one delivery (it queues the one after, with backoff, when it fails)."""
    services.delivery_attempt(delivery_id=delivery_id)


@shared_task(ignore_result=True)
def webhooks_sweep() -> None:
    """Beat: queue deliveries whose message was lost; delete those older than MINT_WEBHOOK_RETENTION_DAYS."""
    services.deliveries_sweep()
