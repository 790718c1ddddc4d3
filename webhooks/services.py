"""Writes of webhooks: endpoints (create, change, delete), deliveries (made from live events, pinged,
redelivered) and their sequence numbers. Each write of a person records an audit event. Attempts, retries and
the sweep are the tasks' (webhooks/tasks.py).

Events arrive through `mint_site.events.on_live_event` (registered in apps.py): adapters and serving send their
live events as ever and know nothing of webhooks. A delivery never waits on another: each is its own task,
and receivers order the events of one subject (a revision: `adapter:<name>:r<n>`) by `sequence`.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection, transaction
from django.utils import timezone

from mint_site.errors import Conflict, MintError, QuotaExceeded
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record
from webhooks import tasks, transport
from webhooks.models import (
    PING,
    URL_MAX_LENGTH,
    WEBHOOK_EVENTS,
    DeliveryState,
    WebhookDelivery,
    WebhookEndpoint,
)

SECRET_PREFIX = "whsec_"

# Live events (mint_site/events.py) → webhook events.
_REVISION_STATES = {"validated", "failed", "exported", "approved", "rejected", "archived"}
_EVALUATION_DONE = {"passed", "failed", "unavailable"}
_CANARY_STATES = {"started", "promoted", "aborted"}
_MEMBER_STATES = {"invited", "invitation_revoked", "joined", "role_changed", "removed"}
# Fields of a live event that are its envelope or internal ids, not what a receiver reads.
_ENVELOPE = {"type", "id", "at", "updated_us"}


def webhook_event_of(event: dict[str, Any]) -> str | None:
    """The webhook event a live event is, or None for the many that are none (placements loading, keys…)."""
    kind, state = event.get("type"), event.get("state")
    if kind == "revision.state" and event.get("restored"):
        return "revision.restored"
    if kind == "revision.state" and state in _REVISION_STATES:
        return f"revision.{state}"
    if kind == "alias.flip":
        return "alias.flipped"
    if kind == "alias.state" and state == "deactivated":
        return "alias.deactivated"
    if kind == "adapter.state" and state == "deleted":
        return "adapter.deleted"
    if kind == "placement.state" and state == "failed":
        return "placement.failed"
    if kind == "evaluation.state" and state in _EVALUATION_DONE:
        return "evaluation.finished"
    if kind == "canary.state" and state in _CANARY_STATES:
        return f"canary.{state}"
    if kind == "member.state" and state in _MEMBER_STATES:
        return f"member.{state}"
    return None


# ---------------------------------------------------------------- endpoints


def _clean_url(url: Any) -> str:
    """The URL, once it is an http(s) URL whose host resolves only to addresses deliveries may reach."""
    if not isinstance(url, str):
        raise MintError("url must be a string.", code="invalid_webhook_url", detail={"url": ["must be a string"]})
    url = url.strip()
    try:
        target = transport.parse_url(url, max_length=URL_MAX_LENGTH)
        addresses = transport.resolve(target.host, target.port, timeout_s=settings.MINT_WEBHOOK_TIMEOUT_S)
        transport.check_addresses(target.host, addresses, allow_private=settings.MINT_WEBHOOK_ALLOW_PRIVATE)
    except transport.Refused as exc:
        raise MintError(f"url: {exc}", code="webhook_url_refused", detail={"url": [str(exc)]}) from None
    except transport.Unresolved as exc:
        raise MintError(f"url: {exc}.", code="webhook_url_unresolved", detail={"url": [str(exc)]}) from None
    return url


def _clean_events(events: Any) -> list[str]:
    if events is None:
        return []
    if isinstance(events, str) or not isinstance(events, Iterable):
        raise MintError("events must be a list of event types.", detail={"events": ["must be a list"]})
    events = list(events)
    if len(events) > 4 * len(WEBHOOK_EVENTS) or any(not isinstance(e, str) for e in events):
        raise MintError("events must be a short list of event types.", detail={"events": ["must be event types"]})
    unknown = sorted({e for e in events if e not in WEBHOOK_EVENTS})
    if unknown:
        shown = ", ".join(repr(e[:64]) for e in unknown[:5])
        raise MintError(
            f"events: unknown event type(s) {shown}; use {', '.join(WEBHOOK_EVENTS)} (or none for all).",
            code="invalid_webhook_event",
            detail={"events": [f"unknown: {e[:64]}" for e in unknown[:20]]},
        )
    return sorted(set(events))


def _check_quota(tenant: Tenant, *, lock: bool = True) -> None:
    """Refuse an endpoint past the plan's `max_webhook_endpoints`; the tenant's row lock serialises the count
    (`lock=False`: an early look, outside any transaction)."""
    rows = Tenant.objects.select_for_update() if lock else Tenant.objects
    locked = rows.get(id=tenant.id)
    count = WebhookEndpoint.objects.filter(tenant=locked).count()
    if count >= locked.max_webhook_endpoints:
        raise QuotaExceeded(
            f"Tenant {locked.slug} already has {count} webhook endpoints, its limit "
            f"(max_webhook_endpoints={locked.max_webhook_endpoints}); delete one first.",
            code="webhook_quota_exceeded",
            detail={"quota": "max_webhook_endpoints", "limit": locked.max_webhook_endpoints},
        )


def _shown(endpoint: WebhookEndpoint) -> dict[str, Any]:
    """What the audit log keeps of an endpoint: never its secret."""
    return {
        "url": endpoint.url,
        "description": endpoint.description,
        "events": endpoint.events,
        "is_active": endpoint.is_active,
    }


def endpoint_create(
    *,
    tenant: Tenant,
    url: str,
    events: Iterable[str] | None = None,
    description: str = "",
    is_active: bool = True,
    created_by: AbstractBaseUser | None,
    by: Actor,
) -> tuple[WebhookEndpoint, str]:
    """Create an endpoint and return it with its signing secret, which no later read shows again.

    The URL is checked before anything is written (scheme, length, and every address its host resolves to).
    """
    _check_quota(tenant, lock=False)  # before the URL's DNS lookup: a tenant at its quota costs no lookup
    clean_url = _clean_url(url)
    clean_events = _clean_events(events)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        _check_quota(tenant)
        endpoint = WebhookEndpoint.objects.create(
            tenant=tenant,
            url=clean_url,
            description=(description or "")[:200],
            secret=secret,
            events=clean_events,
            is_active=bool(is_active),
            created_by=created_by,
        )
        audit_record(
            tenant=tenant, actor=by, action="webhook.create", target=f"webhook:{endpoint.id}", after=_shown(endpoint)
        )
    return endpoint, secret


UPDATABLE = ("url", "description", "events", "is_active")


def endpoint_update(*, endpoint: WebhookEndpoint, changes: dict[str, Any], by: Actor) -> WebhookEndpoint:
    """Change an endpoint's URL, description, events or whether it is active. Its secret stays."""
    unknown = sorted(set(changes) - set(UPDATABLE))
    if unknown:
        raise MintError(f"Cannot change {', '.join(unknown)}; only {', '.join(UPDATABLE)}.")
    clean: dict[str, Any] = {}
    if "url" in changes:
        clean["url"] = _clean_url(changes["url"])
    if "events" in changes:
        clean["events"] = _clean_events(changes["events"])
    if "description" in changes:
        clean["description"] = (changes["description"] or "")[:200]
    if "is_active" in changes:
        clean["is_active"] = bool(changes["is_active"])
    with transaction.atomic():
        locked = WebhookEndpoint.objects.select_for_update().get(id=endpoint.id)
        before = _shown(locked)
        for name, value in clean.items():
            setattr(locked, name, value)
        if clean:
            locked.save(update_fields=list(clean))
            audit_record(
                tenant=locked.tenant,
                actor=by,
                action="webhook.update",
                target=f"webhook:{locked.id}",
                before={name: before[name] for name in clean},
                after={name: _shown(locked)[name] for name in clean},
            )
    return locked


@transaction.atomic
def endpoint_delete(*, endpoint: WebhookEndpoint, by: Actor) -> None:
    """Delete an endpoint and its delivery log. Attempts already running finish; none start after."""
    shown = _shown(endpoint)
    WebhookEndpoint.objects.filter(id=endpoint.id).delete()
    audit_record(
        tenant=endpoint.tenant, actor=by, action="webhook.delete", target=f"webhook:{endpoint.id}", before=shown
    )


# ---------------------------------------------------------------- deliveries


_NEXT_SEQUENCE_SQL = (
    "INSERT INTO webhooks_webhooksequence (tenant_id, subject, last) VALUES (%s, %s, 1) "
    "ON CONFLICT (tenant_id, subject) DO UPDATE SET last = webhooks_webhooksequence.last + 1 RETURNING last"
)


def _next_sequence(*, tenant_id: int, subject: str) -> int:
    """The next number of `subject`'s events, 1 first; one statement, so concurrent events get distinct ones."""
    with connection.cursor() as cursor:
        cursor.execute(_NEXT_SEQUENCE_SQL, [tenant_id, subject])
        return cursor.fetchone()[0]


def webhook_emit(
    *,
    tenant_id: int,
    event: str,
    subject: str,
    data: dict[str, Any],
    occurred_at: str | None = None,
    endpoints: list[WebhookEndpoint] | None = None,
) -> list[WebhookDelivery]:
    """Queue `event` to the tenant's active endpoints subscribed to it (or to `endpoints`, all of this tenant).

    One event id and one sequence number of `subject` for all of them; each delivery is its own task.
    """
    if endpoints is None:
        endpoints = [
            e
            for e in WebhookEndpoint.objects.filter(tenant_id=tenant_id, is_active=True).select_related("tenant")
            if e.wants(event)
        ]
    endpoints = [e for e in endpoints if e.tenant_id == tenant_id]
    if not endpoints:
        return []
    now = timezone.now()
    with transaction.atomic():
        sequence = _next_sequence(tenant_id=tenant_id, subject=subject)
        payload = {
            "id": str(uuid.uuid4()),
            "type": event,
            "created_at": occurred_at or now.isoformat(),
            "tenant": endpoints[0].tenant.slug,
            "subject": subject,
            "sequence": sequence,
            "data": data,
        }
        rows = WebhookDelivery.objects.bulk_create(
            [
                WebhookDelivery(
                    endpoint=endpoint,
                    event=event,
                    subject=subject,
                    sequence=sequence,
                    payload=payload,
                    next_attempt_at=now,
                    created_at=now,
                )
                for endpoint in endpoints
            ]
        )
        tasks.enqueue([row.id for row in rows])
    return rows


def webhook_live_event(*, event: dict[str, Any], tenant_id: int | None, **_: Any) -> None:
    """The live-event listener: a lifecycle event of a tenant becomes a webhook event of that tenant only."""
    kind = webhook_event_of(event)
    if kind is None or tenant_id is None:
        return
    data = {name: value for name, value in event.items() if name not in _ENVELOPE}
    if event["type"] == "evaluation.state":
        data["evaluation_id"] = event["id"]
    adapter, revision = event.get("adapter"), event.get("revision")
    subject = f"adapter:{adapter}:{revision}" if adapter and revision else f"{event['type']}:{event['id']}"
    if event["type"] == "member.state":
        subject = data.pop("subject")  # member:<username or address>: one person's changes in order
    webhook_emit(tenant_id=tenant_id, event=kind, subject=subject, data=data, occurred_at=event.get("at"))


def _check_backlog(tenant: Tenant) -> None:
    """Pings and redeliveries, which a person asks for, wait while the tenant has MINT_WEBHOOK_MAX_PENDING
    deliveries pending (429): a tenant cannot pile up attempts its one slot at a time would never get through."""
    pending = WebhookDelivery.objects.filter(endpoint__tenant_id=tenant.id, state=DeliveryState.PENDING)
    if pending.count() >= settings.MINT_WEBHOOK_MAX_PENDING:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} has {settings.MINT_WEBHOOK_MAX_PENDING} webhook deliveries pending "
            "(MINT_WEBHOOK_MAX_PENDING); ping or redeliver once they are through.",
            code="webhook_backlog_full",
        )


def endpoint_ping(*, endpoint: WebhookEndpoint, by: Actor) -> WebhookDelivery:
    """Send a `ping` event to one endpoint (whatever it subscribes to), to test the receiver and its check."""
    if not endpoint.is_active:
        raise Conflict(f"webhook:{endpoint.id} is disabled; enable it to ping it.", code="webhook_disabled")
    _check_backlog(endpoint.tenant)
    with transaction.atomic():
        (delivery,) = webhook_emit(
            tenant_id=endpoint.tenant_id,
            event=PING,
            subject=f"webhook:{endpoint.id}",
            data={"webhook": endpoint.id, "by": by.label},
            endpoints=[endpoint],
        )
        audit_record(
            tenant=endpoint.tenant,
            actor=by,
            action="webhook.ping",
            target=f"webhook:{endpoint.id}",
            after={"delivery": str(delivery.uid)},
        )
    return delivery


@transaction.atomic
def delivery_redeliver(*, delivery: WebhookDelivery, by: Actor) -> WebhookDelivery:
    """Send a delivery's event again, as a new delivery (a new `X-Mint-Delivery`; the same event id and sequence)."""
    endpoint = delivery.endpoint
    if not endpoint.is_active:
        raise Conflict(f"webhook:{endpoint.id} is disabled; enable it to redeliver to it.", code="webhook_disabled")
    if delivery.state == DeliveryState.PENDING:
        raise Conflict(
            f"{delivery.event} #{delivery.sequence} is still pending (attempt {delivery.attempts} of "
            f"{settings.MINT_WEBHOOK_MAX_ATTEMPTS}); redeliver it once it is delivered or has failed.",
            code="delivery_pending",
        )
    _check_backlog(endpoint.tenant)
    now = timezone.now()
    again = WebhookDelivery.objects.create(
        endpoint=endpoint,
        event=delivery.event,
        subject=delivery.subject,
        sequence=delivery.sequence,
        payload=delivery.payload,
        next_attempt_at=now,
        created_at=now,
        redelivery_of=delivery,
    )
    audit_record(
        tenant=endpoint.tenant,
        actor=by,
        action="webhook.redeliver",
        target=f"webhook:{endpoint.id}",
        after={"delivery": str(again.uid), "of": str(delivery.uid), "event": delivery.event},
    )
    tasks.enqueue([again.id])
    return again
