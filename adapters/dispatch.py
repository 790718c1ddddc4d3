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

Stuck work has an end. A revision in its stage (registered: validating; validated: exporting) for longer
than MINT_STAGE_STALE_AFTER_S is shown as stalled (`stalled_since`). One handed to the workers that has not
finished within `lost_after_s()` (that bound, and at least the tasks' hard time limit: whatever ran it has
ended by then) was lost with its worker or on the way: each dispatch puts it back in the queue, counting the
lost hand-off as a delivery, and past MINT_TASK_MAX_DELIVERIES fails it with `<stage>_lost`, which a Retry
may clear (adapters.services.revision_retry).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Min
from django.utils import timezone

# adapters.services imports this module too: only its attributes are read here, at call time.
from adapters import services, tasks
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from mint_site.errors import InvalidTransition
from mint_site.sandbox import background_thread
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)

CONTROL_STATES = (S.REGISTERED, S.VALIDATED)
_LOCK_ID = 0x6D696E74  # "mint": one advisory lock serialises dispatching across processes


def _lock() -> None:
    """Serialise dispatchers: PostgreSQL's advisory lock; SQLite serialises writing transactions by itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_ID])


def control_dispatch() -> list[int]:
    """Hand waiting revisions to the control workers while there is room; returns the ids handed over.

    Lost hand-offs go back in the queue first (or fail, past the delivery bound): `requeue_lost`.
    """
    with transaction.atomic():
        _lock()
        now = timezone.now()
        requeue_lost(now=now)
        chosen = _choose(now)
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


def stalled_since(revision: AdapterRevision, *, now: datetime | None = None) -> datetime | None:
    """When a revision still validating or exporting entered that stage, if longer than MINT_STAGE_STALE_AFTER_S
    ago (it is stalled); None otherwise. Reads only the row (`updated_at` is when its state last changed)."""
    if revision.state not in CONTROL_STATES:
        return None
    now = now or timezone.now()
    stale = timedelta(seconds=settings.MINT_STAGE_STALE_AFTER_S)
    return revision.updated_at if now - revision.updated_at > stale else None


def stall_reason(revision: AdapterRevision, *, now: datetime | None = None) -> str | None:
    """A sentence for a stalled revision (None if it is not): waiting for a worker, or handed over and not back."""
    since = stalled_since(revision, now=now)
    if since is None:
        return None
    stage = "validation" if revision.state == S.REGISTERED else "export"
    if revision.dispatched_at is None:
        return (
            f"Its {stage} waits for a control worker: the workers are busy, and the queue takes tenants in turn "
            f"(this tenant's earlier revisions, and its plan's max_concurrent_tasks, go first)."
        )
    return (
        f"Its {stage} was handed to a worker at {revision.dispatched_at:%H:%M:%S} UTC and has not finished. If no "
        f"worker runs it, it is handed over again {round(lost_after_s() / 60)} min after, and fails "
        f"({stage}_lost, retryable) after {settings.MINT_TASK_MAX_DELIVERIES} lost deliveries."
    )


def lost_after_s() -> float:
    """How long a revision handed to the workers may go unfinished before the hand-off counts as lost: the stale
    bound, and never less than the tasks' hard time limit (a task still running is not handed over twice)."""
    limits = [tasks.revision_validate.time_limit, tasks.revision_export.time_limit]
    return float(max([settings.MINT_STAGE_STALE_AFTER_S, *(limit for limit in limits if limit)]))


def requeue_lost(*, now: datetime | None = None, limit: int = 100) -> dict[str, int]:
    """Put revisions whose hand-off was lost back in the queue, or fail them past the delivery bound.

    Lost: handed to the workers (`dispatched_at`) and in the same stage since, both longer than `lost_after_s()`
    ago. A worker killed mid-task, a broker that dropped the message, or a queue nobody consumes all look alike
    here; each counts as one delivery that did not come back (a killed worker's start was counted already, so it
    may count twice: the bound is then reached sooner, never later). Call under the dispatch lock.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=lost_after_s())
    lost = list(
        AdapterRevision.objects.filter(
            state__in=CONTROL_STATES, dispatched_at__lt=cutoff, updated_at__lt=cutoff, adapter__tenant__is_active=True
        )
        .select_related("adapter__tenant")
        .order_by("dispatched_at", "id")[:limit]
    )
    requeued = failed = 0
    bound = settings.MINT_TASK_MAX_DELIVERIES
    for revision in lost:
        stage = "validation" if revision.state == S.REGISTERED else "export"
        if revision.deliveries >= bound:
            reason = (
                f"The {stage} of r{revision.number} was handed to the control workers {revision.deliveries} times "
                f"and never finished (no worker took it, or the worker running it was lost). This is not a "
                "problem in the files: Retry it once the workers run again; an operator can see their logs."
            )
            try:
                services.revision_fail(revision=revision, code=f"{stage}_lost", reason=reason)
            except InvalidTransition:
                continue  # it moved meanwhile
            failed += 1
            continue
        moved = AdapterRevision.objects.filter(
            id=revision.id, state=revision.state, dispatched_at=revision.dispatched_at
        ).update(dispatched_at=None, deliveries=F("deliveries") + 1)
        if not moved:
            continue
        log.warning("%s: the %s hand-off of %s was lost; queued again", revision.adapter.tenant, stage, revision)
        audit_record(
            tenant=revision.adapter.tenant,
            actor=Actor.system(),
            action="revision.requeue",
            target=services.transitions.audit_target(revision),
            before={"state": revision.state, "dispatched_at": revision.dispatched_at.isoformat()},
            after={"state": revision.state, "deliveries": revision.deliveries + 1, "limit": bound},
        )
        requeued += 1
    return {"requeued": requeued, "failed": failed}


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
