"""Delivering webhooks: the Celery task that makes one attempt of a delivery, the attempt itself (a tenant's
attempt slots, the signed POST, the retry with backoff) and the sweep that finds deliveries whose message was lost.

Deliveries run on a queue of their own, `webhooks`, taken by a worker pool of their own (`make run` starts one:
devtools/launcher.py), so that receivers that answer slowly or never hold those threads only, never the control
workers every tenant's validation and export need. The sweep stays on `control`. An attempt queues the next one
itself (the tenant's delivery due longest, or its own retry), so the task and its work live here together;
webhooks/services.py creates deliveries and queues their first attempt (`enqueue`).
"""

from __future__ import annotations

import json
import logging
import math
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from webhooks import transport
from webhooks.models import URL_MAX_LENGTH, DeliveryState, WebhookDelivery

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 3600.0
# While an attempt runs its delivery is not due before this much past the attempt's time limit.
LEASE_SLACK_S = 30.0
# The sweep queues a pending delivery again only when it is this overdue (its own message was lost).
SWEEP_GRACE_S = 60.0
SWEEP_BATCH = 1000

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
    delivery_attempt(delivery_id=delivery_id)


@shared_task(ignore_result=True)
def webhooks_sweep() -> None:
    """Beat: queue deliveries whose message was lost; delete those older than MINT_WEBHOOK_RETENTION_DAYS."""
    deliveries_sweep()


def enqueue(delivery_ids: list[int], *, countdown: float = 0) -> None:
    """Queue an attempt of each delivery once the surrounding transaction commits (at once outside one)."""

    def send() -> None:
        for delivery_id in delivery_ids:
            webhook_deliver.apply_async(kwargs={"delivery_id": delivery_id}, countdown=countdown or None)

    transaction.on_commit(send)


def backoff_s(attempts: int) -> float:
    """The wait after the `attempts`-th failed attempt: MINT_WEBHOOK_BACKOFF_S, doubling, at most an hour."""
    return min(settings.MINT_WEBHOOK_BACKOFF_S * 2 ** max(0, attempts - 1), BACKOFF_MAX_S)


def body_of(delivery: WebhookDelivery) -> bytes:
    """The exact bytes POSTed (and signed)."""
    return json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True).encode()


def _slot_key(tenant_id: int, n: int) -> str:
    return f"webhook-slot:{tenant_id}:{n}"


def _take_slot(tenant_id: int) -> str | None:
    """One of the tenant's MINT_WEBHOOK_TENANT_CONCURRENCY attempt slots (a cache key held for one attempt's
    lease at most), or None when all are taken. Redis unreachable: the attempt goes ahead (logged)."""
    lease = math.ceil(settings.MINT_WEBHOOK_TIMEOUT_S + LEASE_SLACK_S)
    try:
        for n in range(settings.MINT_WEBHOOK_TENANT_CONCURRENCY):
            if cache.add(_slot_key(tenant_id, n), 1, timeout=lease):
                return _slot_key(tenant_id, n)
    except Exception as exc:  # the cache is Redis; a delivery is not lost for its loss
        log.warning("webhooks: attempt slots unavailable (%s); attempting without one", exc)
        return ""
    return None


def _give_slot(key: str) -> None:
    if key:
        try:
            cache.delete(key)
        except Exception as exc:
            log.warning("webhooks: attempt slot %s not released (%s); it expires with its lease", key, exc)


def _next_due(tenant_id: int) -> int | None:
    """The tenant's pending delivery due longest, for the attempt that just gave its slot back to chain to."""
    return (
        WebhookDelivery.objects.filter(
            endpoint__tenant_id=tenant_id, state=DeliveryState.PENDING, next_attempt_at__lte=timezone.now()
        )
        .order_by("next_attempt_at")
        .values_list("id", flat=True)
        .first()
    )


def delivery_attempt(*, delivery_id: int) -> str:
    """Make the next attempt of a pending delivery that is due; returns what became of it (or why nothing).

    A tenant makes at most MINT_WEBHOOK_TENANT_CONCURRENCY attempts at once, so its slow or silent receivers hold
    that many worker processes at most, for MINT_WEBHOOK_TIMEOUT_S each: a task finding every slot taken leaves
    its delivery due and ends ("busy"); each attempt that ends queues the tenant's delivery due longest, and the
    sweep catches any chain a lost worker broke. The claim is a conditional update (pending, due) that pushes
    `next_attempt_at` past the attempt's limit and counts the attempt, so a duplicate message, the sweep and a
    redelivered task never attempt it twice at once. The HTTP request runs outside any transaction.
    """
    tenant_id = (
        WebhookDelivery.objects.filter(id=delivery_id, state=DeliveryState.PENDING)
        .values_list("endpoint__tenant_id", flat=True)
        .first()
    )
    if tenant_id is None:
        log.info("webhook delivery %s is gone or done; nothing to do", delivery_id)
        return "skipped"
    slot = _take_slot(tenant_id)
    if slot is None:
        log.info("webhook delivery %s waits: tenant %s has every attempt slot in use", delivery_id, tenant_id)
        return "busy"
    try:
        result = _attempt(delivery_id)
    finally:
        _give_slot(slot)
    if result != "skipped" and (following := _next_due(tenant_id)) is not None:
        enqueue([following])
    return result


def _attempt(delivery_id: int) -> str:
    now = timezone.now()
    lease = now + timedelta(seconds=settings.MINT_WEBHOOK_TIMEOUT_S + LEASE_SLACK_S)
    claimed = WebhookDelivery.objects.filter(
        id=delivery_id, state=DeliveryState.PENDING, next_attempt_at__lte=now
    ).update(next_attempt_at=lease, attempts=F("attempts") + 1)
    if claimed != 1:
        log.info("webhook delivery %s is gone, done or not due; nothing to do", delivery_id)
        return "skipped"
    delivery = WebhookDelivery.objects.select_related("endpoint").filter(id=delivery_id).first()
    if delivery is None:
        return "skipped"
    endpoint = delivery.endpoint
    mine = WebhookDelivery.objects.filter(id=delivery.id, state=DeliveryState.PENDING, attempts=delivery.attempts)
    if not endpoint.is_active:
        mine.update(state=DeliveryState.FAILED, next_attempt_at=None, last_error="The endpoint is disabled.")
        return DeliveryState.FAILED
    outcome = transport.post_signed(
        url=endpoint.url,
        body=body_of(delivery),
        headers={"X-Mint-Event": delivery.event, "X-Mint-Delivery": str(delivery.uid)},
        secret=endpoint.secret,
        timeout_s=settings.MINT_WEBHOOK_TIMEOUT_S,
        connect_timeout_s=settings.MINT_WEBHOOK_CONNECT_TIMEOUT_S,
        max_bytes=settings.MINT_WEBHOOK_MAX_RESPONSE_BYTES,
        allow_private=settings.MINT_WEBHOOK_ALLOW_PRIVATE,
        max_url_length=URL_MAX_LENGTH,
    )
    done = timezone.now()
    if outcome.delivered:
        mine.update(
            state=DeliveryState.DELIVERED,
            delivered_at=done,
            next_attempt_at=None,
            last_status_code=outcome.status_code,
            last_error="",
        )
        return DeliveryState.DELIVERED
    error = outcome.error[:1000]
    if outcome.permanent or delivery.attempts >= settings.MINT_WEBHOOK_MAX_ATTEMPTS:
        if not outcome.permanent:
            error = f"{error} (gave up after {delivery.attempts} attempts)"
        mine.update(
            state=DeliveryState.FAILED, next_attempt_at=None, last_status_code=outcome.status_code, last_error=error
        )
        log.info("webhook delivery %s failed: %s", delivery.uid, error)
        return DeliveryState.FAILED
    wait = backoff_s(delivery.attempts)
    if mine.update(
        next_attempt_at=done + timedelta(seconds=wait), last_status_code=outcome.status_code, last_error=error
    ):
        enqueue([delivery.id], countdown=wait)
    return DeliveryState.PENDING


def deliveries_sweep() -> dict[str, int]:
    """Queue pending deliveries well past due (their message was lost), and delete old finished ones."""
    now = timezone.now()
    # At most as many per tenant as it may attempt at once (the rest follow by the chain): a tenant with a
    # thousand overdue deliveries neither fills the batch nor queues a thousand tasks that would find it busy.
    overdue = list(
        WebhookDelivery.objects.filter(
            state=DeliveryState.PENDING, next_attempt_at__lte=now - timedelta(seconds=SWEEP_GRACE_S)
        )
        .annotate(
            turn=Window(RowNumber(), partition_by=[F("endpoint__tenant_id")], order_by=F("next_attempt_at").asc())
        )
        .filter(turn__lte=settings.MINT_WEBHOOK_TENANT_CONCURRENCY)
        .order_by("next_attempt_at")
        .values_list("id", flat=True)[:SWEEP_BATCH]
    )
    for delivery_id in overdue:
        webhook_deliver.delay(delivery_id=delivery_id)
    cutoff = now - timedelta(days=settings.MINT_WEBHOOK_RETENTION_DAYS)
    old = list(
        WebhookDelivery.objects.filter(created_at__lt=cutoff)
        .exclude(state=DeliveryState.PENDING)
        .values_list("id", flat=True)[:10_000]
    )
    purged = WebhookDelivery.objects.filter(id__in=old).delete()[0] if old else 0
    return {"queued": len(overdue), "purged": purged}
