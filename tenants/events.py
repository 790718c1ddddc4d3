"""Live events for the dashboard: broadcast to Channels groups after the surrounding transaction commits.

Group names come from here only: `tenant.<id>` for a tenant's members, `platform` for
staff. An event carries the names of one tenant's objects and goes to that tenant's
group (and to staff); events about shared infrastructure (nodes) go to staff only.
A channel layer that cannot be reached (Redis down) is logged, never raised: the
change it reports is already committed.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone

log = logging.getLogger(__name__)

PLATFORM_GROUP = "platform"
MESSAGE_TYPE = "live.event"  # handled by `LiveEventsConsumer.live_event`


def tenant_group(tenant_id: int) -> str:
    return f"tenant.{tenant_id}"


def live_event(*, tenant_id: int | None, type: str, id: int, state: str, **fields: Any) -> None:
    """Send `{"type", "id", "state", "at", **fields}` to the tenant's group and to staff, once committed.

    `tenant_id=None` for platform-only events. Outside a transaction it is sent at once.
    """
    event = {"type": type, "id": id, "state": state, "at": timezone.now().isoformat(), **fields}
    groups = ([tenant_group(tenant_id)] if tenant_id is not None else []) + [PLATFORM_GROUP]
    transaction.on_commit(lambda: _send(groups, event, tenant_id))


def _send(groups: list[str], event: dict[str, Any], tenant_id: int | None = None) -> None:
    try:
        layer = get_channel_layer()
        if layer is None:
            return
        send = async_to_sync(layer.group_send)
        for group in groups:
            # `tenant_id` rides outside the event: consumers use it to keep one tenant's names from another's page.
            send(group, {"type": MESSAGE_TYPE, "event": event, "tenant_id": tenant_id})
    except Exception:  # a broken broadcast must not break the service that committed
        log.warning("live event %s %s not sent", event["type"], event["id"], exc_info=True)
