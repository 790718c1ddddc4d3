"""Live events for the dashboard: broadcast to Channels groups after the surrounding transaction commits.

Group names come from here only: `tenant.<id>` for a tenant's members, `platform` for
staff. An event carries the names of one tenant's objects and goes to that tenant's
group (and to staff); events about shared infrastructure (nodes) go to staff only.
A channel layer that cannot be reached (Redis down) is logged, never raised: the
change it reports is already committed.

Synchronous code (services, Celery tasks) sends through one event loop per process, run
by a daemon thread: `async_to_sync` would build a new loop, and with it a new Redis
connection, for every send (about 5 ms of CPU an event, on the hosts that serve).

Apps above the one that sends can react to its events without being imported by it: `on_live_event`
registers a listener (an AppConfig's `ready`, e.g. webhooks), called with each event once committed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from channels.layers import get_channel_layer
from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

log = logging.getLogger(__name__)

PLATFORM_GROUP = "platform"
MESSAGE_TYPE = "live.event"  # handled by `LiveEventsConsumer.live_event`
SEND_TIMEOUT_S = 5.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def tenant_group(tenant_id: int) -> str:
    return f"tenant.{tenant_id}"


def epoch_us(moment: datetime) -> int:
    """Microseconds since the Unix epoch, exactly (the order of an object's changes, for pages that patch)."""
    return (moment - EPOCH) // timedelta(microseconds=1)


def live_event(*, tenant_id: int | None, type: str, id: int, state: str, **fields: Any) -> None:
    """Send `{"type", "id", "state", "at", **fields}` to the tenant's group and to staff, once committed.

    `tenant_id=None` for platform-only events. Outside a transaction it is sent at once.
    """
    event = {"type": type, "id": id, "state": state, "at": timezone.now().isoformat(), **fields}
    groups = ([tenant_group(tenant_id)] if tenant_id is not None else []) + [PLATFORM_GROUP]
    transaction.on_commit(lambda: _committed(groups, event, tenant_id))


# Listeners of committed live events: receivers get `event=<the dict>, tenant_id=<int or None>`.
_committed_events = Signal()


def on_live_event(listener: Callable[..., None], *, uid: str) -> None:
    """Call `listener(event=…, tenant_id=…)` with every live event once it is committed (idempotent per `uid`).

    Listeners run in the process that committed, after the broadcast: keep them short (a query or two). One
    that raises is logged, never raised: the change the event reports is already committed.
    """
    _committed_events.connect(listener, weak=False, dispatch_uid=uid)


def _committed(groups: list[str], event: dict[str, Any], tenant_id: int | None) -> None:
    _send(groups, event, tenant_id)
    for receiver, outcome in _committed_events.send_robust(sender=None, event=event, tenant_id=tenant_id):
        if isinstance(outcome, Exception):
            log.warning(
                "listener %r failed on live event %s %s",
                receiver,
                event["type"],
                event["id"],
                exc_info=(type(outcome), outcome, outcome.__traceback__),
            )


class _Sender:
    """The process's event loop for sending from synchronous code, started on first use.

    The layer keeps one Redis connection pool per event loop, so this loop's connections are
    reused from one send to the next. A forked child (a Celery pool process) starts its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # The parent's loop thread does not exist here, and its lock may have been held at the fork.
        self._lock = threading.Lock()
        self._loop = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="live-events", daemon=True).start()
                self._loop = loop
            return self._loop

    def send(self, layer, groups: list[str], message: dict[str, Any]) -> None:
        """Send `message` to each group in order; wait at most SEND_TIMEOUT_S for all of them."""

        async def send_all() -> None:
            for group in groups:
                await layer.group_send(group, message)

        future = asyncio.run_coroutine_threadsafe(send_all(), self._running_loop())
        try:
            future.result(SEND_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise


_sender = _Sender()


def _send(groups: list[str], event: dict[str, Any], tenant_id: int | None = None) -> None:
    try:
        layer = get_channel_layer()
        if layer is None:
            return
        # `tenant_id` rides outside the event: consumers use it to keep one tenant's names from another's page.
        _sender.send(layer, groups, {"type": MESSAGE_TYPE, "event": event, "tenant_id": tenant_id})
    except Exception:  # a broken broadcast must not break the service that committed
        log.warning("live event %s %s not sent", event["type"], event["id"], exc_info=True)
