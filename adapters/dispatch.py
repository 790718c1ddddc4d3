"""The control queue: which revision's validation or export the workers take next, fairly across tenants.

Registering a revision does not put a task on the broker. The revision waits in the
catalog (`registered` or `validated`, `dispatched_at` empty), and `control_dispatch`
hands work to the workers only while fewer than MINT_CONTROL_CONCURRENCY revisions are
being worked on, and a tenant only while it has fewer than its plan's
`max_concurrent_tasks`. Among tenants with room it picks the one with the least work
running, then the one waiting longest: one tenant's burst of uploads (or its poison
tasks) then delays another tenant's next revision by at most one task's length, since
the broker never holds more than the workers can start. A dispatched revision keeps its
place from validation through export; it frees it by reaching `exported` or `failed`,
and every such change dispatches again (after commit). Beat also dispatches every few
seconds, in case a hand-off was lost.
"""

from __future__ import annotations

import contextlib
import logging

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Min
from django.utils import timezone

from adapters import tasks
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from mint_site.sandbox import background_thread

log = logging.getLogger(__name__)

CONTROL_STATES = (S.REGISTERED, S.VALIDATED)
_LOCK_ID = 0x6D696E74  # "mint": one advisory lock serialises dispatching across processes


def _lock() -> None:
    """Serialise dispatchers: PostgreSQL's advisory lock; SQLite serialises writing transactions by itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_ID])


def control_dispatch() -> list[int]:
    """Hand waiting revisions to the control workers while there is room; returns the ids handed over."""
    with transaction.atomic():
        _lock()
        chosen = _choose(timezone.now())
        transaction.on_commit(lambda: [_send(revision_id, state) for revision_id, state in chosen])
    return [revision_id for revision_id, _ in chosen]


def _choose(now) -> list[tuple[int, str]]:
    queue = AdapterRevision.objects.filter(state__in=CONTROL_STATES, adapter__tenant__is_active=True)
    running: dict[int, int] = dict(
        queue.filter(dispatched_at__isnull=False)
        .values_list("adapter__tenant")
        .annotate(n=Count("id"))
        .values_list("adapter__tenant", "n")
    )
    free = settings.MINT_CONTROL_CONCURRENCY - sum(running.values())
    if free <= 0:
        return []
    waiting = {}
    backlog: dict[int, int] = {}
    for tenant, cap, oldest, count in (
        queue.filter(dispatched_at__isnull=True)
        .values_list("adapter__tenant", "adapter__tenant__max_concurrent_tasks")
        .annotate(oldest=Min("created_at"), count=Count("id"))
        .values_list("adapter__tenant", "adapter__tenant__max_concurrent_tasks", "oldest", "count")
    ):
        waiting[tenant], backlog[tenant] = (cap, oldest), count
    chosen: list[tuple[int, str]] = []
    while free > 0:
        # A tenant with a backlog takes the last free place only while no tenant without one has work: a
        # newcomer then always finds a place, and a burst's next task never starts beside another's revision.
        light = any(backlog.get(t, 0) <= 1 for t in set(running) | set(waiting))
        open_tenants = [
            t
            for t, (cap, _) in waiting.items()
            if running.get(t, 0) < cap and (backlog[t] <= 1 or free > 1 or not light)
        ]
        if not open_tenants:
            break
        tenant = min(open_tenants, key=lambda t: (running.get(t, 0), waiting[t][1]))
        revision = (
            queue.filter(adapter__tenant=tenant, dispatched_at__isnull=True)
            .order_by("created_at", "id")
            .values_list("id", "state")
            .first()
        )
        if revision is None:  # pragma: no cover - the aggregate above saw one
            del waiting[tenant]
            continue
        AdapterRevision.objects.filter(id=revision[0]).update(dispatched_at=now)
        chosen.append(revision)
        running[tenant] = running.get(tenant, 0) + 1
        free -= 1
        later = (
            queue.filter(adapter__tenant=tenant, dispatched_at__isnull=True)
            .order_by("created_at")
            .values_list("created_at", flat=True)
            .first()
        )
        backlog[tenant] -= 1
        if later is None:
            del waiting[tenant]
        else:
            waiting[tenant] = (waiting[tenant][0], later)
    return chosen


def waiting(*, tenant_id: int) -> int:
    """How many of a tenant's revisions wait for a place in the queue (its backlog)."""
    return AdapterRevision.objects.filter(
        adapter__tenant_id=tenant_id, state__in=CONTROL_STATES, dispatched_at__isnull=True
    ).count()


def backlog_priority(*, tenant_id: int):
    """A context for a tenant's bulk work in a request thread: the lowest CPU priority while it has a backlog.

    A tenant working through a backlog (uploads faster than they are validated) gets what the machine
    has left; a tenant with one revision at a time is served as if alone (mint_site/sandbox.py).
    """
    return background_thread() if waiting(tenant_id=tenant_id) else contextlib.nullcontext()


def _send(revision_id: int, state: str) -> None:
    task = tasks.revision_validate if state == S.REGISTERED else tasks.revision_export
    task.delay(revision_id=revision_id)


def dispatch_on_commit() -> None:
    """Dispatch once the surrounding transaction commits (a revision left the queue or joined it)."""
    transaction.on_commit(control_dispatch)
