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

A hand-off no worker has begun is lost much sooner, and safely: nothing runs it. Each task records when a
worker began it (`picked_up_at`, `begin`), and a hand-off carries its own time (`dispatched_at`), so a copy
superseded by a later hand-off does nothing. Redis without persistence loses every task it holds when it
restarts; the workers merely being down loses nothing. To tell the two apart, beat's dispatch sends a probe
(`tasks.control_probe`) behind hand-offs that have waited MINT_TASK_PICKUP_S unbegun; the queue is first in,
first out, so a worker that takes the probe has taken everything sent before it, and what is still unbegun
then was lost: it is handed over again and counted like any lost hand-off (the rule is adapters/handoffs.py). A
rollback's re-export, which serving asks for outside the queue, is sent again the same way (`export_redrive`).

The tasks (adapters/tasks.py) run the work this queue hands out, and that work frees places in it: the services
dispatch again when a revision leaves the queue. So the queue names its tasks instead of importing them
(`_control_task`); adapters.apps registers them in every process.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta

from celery import Task
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Min, Q
from django.utils import timezone

from adapters import handoffs, store
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from adapters.states import audit_target, revision_mark_failed
from mint_site.celery import app as celery_app
from mint_site.errors import InvalidTransition
from mint_site.sandbox import background_thread
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)

CONTROL_STATES = (S.REGISTERED, S.VALIDATED)
RESTORABLE_STATES = (S.EXPORTED, S.PENDING_APPROVAL, S.APPROVED)  # frozen: a removed export is written again
# When a revision's current task was sent: its hand-off, or (an export sent as its validation ended) its stage's start.
SENT = ("updated_at", "dispatched_at")
_LOCK_ID = 0x6D696E74  # "mint": one advisory lock serialises dispatching across processes

# Celery's own limits for the control tasks, for what runs in the worker itself (store I/O, the database): only a
# runaway there reaches them, and only the prefork pool enforces them. The sandboxed part has its own, shorter.
_OUTER_SLACK_S = 120
TASK_LIMITS = {
    "soft_time_limit": settings.MINT_TASK_TIME_LIMIT_S + _OUTER_SLACK_S,
    "time_limit": settings.MINT_TASK_TIME_LIMIT_S + 2 * _OUTER_SLACK_S,
}


def _lock() -> None:
    """Serialise dispatchers: PostgreSQL's advisory lock; SQLite serialises writing transactions by itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_ID])


def control_dispatch(*, passed_before: datetime | None = None) -> list[int]:
    """Hand waiting revisions to the control workers while there is room; returns the ids handed over.

    Lost hand-offs go back in the queue first (or fail, past the delivery bound): `requeue_lost`, to which
    `passed_before` (a probe's) says how far the queue has provably moved.
    """
    with transaction.atomic():
        _lock()
        now = timezone.now()
        requeue_lost(now=now, passed_before=passed_before)
        chosen = _choose(now)
        transaction.on_commit(lambda: [_send(revision_id, state, handed=now) for revision_id, state in chosen])
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
        AdapterRevision.objects.filter(id=revision[0]).update(dispatched_at=now, picked_up_at=None)
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
    if not begun(revision):
        return (
            f"Its {stage} was handed to a worker at {revision.dispatched_at:%H:%M:%S} UTC and no worker has begun it. "
            f"If the broker lost it, it is handed over again once the queue has moved past it; if the workers are "
            f"down, it waits for them. It fails ({stage}_lost, retryable) after "
            f"{settings.MINT_TASK_MAX_DELIVERIES} lost deliveries."
        )
    return (
        f"Its {stage} was handed to a worker at {revision.dispatched_at:%H:%M:%S} UTC and has not finished. If no "
        f"worker runs it, it is handed over again {round(lost_after_s() / 60)} min after it began, and fails "
        f"({stage}_lost, retryable) after {settings.MINT_TASK_MAX_DELIVERIES} lost deliveries."
    )


def lost_after_s() -> float:
    """How long a revision handed to the workers may go unfinished before the hand-off counts as lost: the stale
    bound, and never less than the tasks' hard time limit (a task still running is not handed over twice)."""
    return float(max(settings.MINT_STAGE_STALE_AFTER_S, TASK_LIMITS["time_limit"]))


def begun(revision: AdapterRevision) -> bool:
    """Whether a worker began the current stage's task of a handed-over revision: `handoffs.unbegun(*SENT)`, read
    on the row (a validated revision's export is sent when its validation ends: a pick-up before was validation's)."""
    picked = revision.picked_up_at
    return picked is not None and picked >= revision.updated_at and picked >= (revision.dispatched_at or picked)


def _handed_over():
    return AdapterRevision.objects.filter(state__in=CONTROL_STATES, adapter__tenant__is_active=True)


def requeue_lost(
    *, now: datetime | None = None, passed_before: datetime | None = None, limit: int = 100
) -> dict[str, int]:
    """Put revisions whose hand-off was lost back in the queue, or fail them past the delivery bound.

    Lost, either way: handed to the workers (`dispatched_at`) and in the same stage since, both longer than
    `lost_after_s()` ago, and not begun since then either (a worker killed mid-task, a broker that dropped the
    message, or a queue nobody consumes all look alike here); or, given `passed_before` (the time a probe that
    reached a worker was sent: the queue is past everything sent before it), handed over MINT_TASK_PICKUP_S
    before that and still not begun. Each counts as one delivery that did not come back (a killed worker's start
    was counted already, so it may count twice: the bound is then reached sooner, never later). Call under the
    dispatch lock.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=lost_after_s())
    overdue = handoffs.overdue(*SENT, before=cutoff)
    if passed_before is not None:
        overdue |= handoffs.unbegun(*SENT, before=passed_before - handoffs.pickup())
    lost = list(
        _handed_over().filter(overdue).select_related("adapter__tenant").order_by("dispatched_at", "id")[:limit]
    )
    requeued = failed = 0
    bound = settings.MINT_TASK_MAX_DELIVERIES
    for revision in lost:
        stage = "validation" if revision.state == S.REGISTERED else "export"
        if revision.deliveries >= bound:
            reason = (
                f"The {stage} of r{revision.number} was handed to the control workers {revision.deliveries} times "
                f"and never finished (no worker took it, the broker lost it, or the worker running it was lost). "
                "This is not a problem in the files: Retry it once the workers run again; an operator can see "
                "their logs."
            )
            try:
                revision_mark_failed(revision, code=f"{stage}_lost", reason=reason)
            except InvalidTransition:
                continue  # it moved meanwhile
            dispatch_on_commit()  # its place in the queue is free
            failed += 1
            continue
        # Conditional on what was read: a worker that begins the task meanwhile keeps it (and one that begins the
        # task after this commits finds its hand-off superseded: `begin`).
        moved = AdapterRevision.objects.filter(
            id=revision.id,
            state=revision.state,
            dispatched_at=revision.dispatched_at,
            picked_up_at=revision.picked_up_at,
        ).update(dispatched_at=None, picked_up_at=None, deliveries=F("deliveries") + 1)
        if not moved:
            continue
        log.warning("%s: the %s hand-off of %s was lost; queued again", revision.adapter.tenant, stage, revision)
        audit_record(
            tenant=revision.adapter.tenant,
            actor=Actor.system(),
            action="revision.requeue",
            target=audit_target(revision),
            before={"state": revision.state, "dispatched_at": revision.dispatched_at.isoformat()},
            after={"state": revision.state, "deliveries": revision.deliveries + 1, "limit": bound},
        )
        requeued += 1
    return {"requeued": requeued, "failed": failed}


def probe_unbegun(*, now: datetime | None = None) -> bool:
    """Send a probe behind hand-offs that have waited MINT_TASK_PICKUP_S unbegun, if any (beat's dispatch).

    The probe expires after that long: probes sent while the workers are down do not pile up for them.
    """
    now = now or timezone.now()
    if not _handed_over().filter(handoffs.unbegun(*SENT, before=now - handoffs.pickup())).exists():
        return False
    _control_task("control_probe").apply_async(
        kwargs={"sent_at": now.isoformat()}, expires=handoffs.pickup().total_seconds()
    )
    return True


def begin(revision: AdapterRevision, *, handed: datetime | None) -> bool:
    """A worker begins the current stage's task of `revision` (validation or export): record it, unless this
    copy of the task was superseded. False: leave it alone.

    `handed` is the hand-off the copy came with (`dispatched_at` when it was sent): another one means the
    revision was handed over again since (its first copy was presumed lost) and that copy runs instead. An
    export without it (sent when validation ended) is superseded by a hand-off made after the stage began. A
    second copy of the same hand-off (the broker delivers it again after its worker was lost) runs again:
    deliveries count it (`services.revision_delivery_start`).
    """
    current = AdapterRevision.objects.filter(id=revision.id, state=revision.state)
    if handed is not None:
        current = current.filter(dispatched_at=handed)
    elif revision.state == S.VALIDATED:
        current = current.exclude(dispatched_at__gt=F("updated_at"))
    now = timezone.now()
    if not current.update(picked_up_at=now):
        log.info("%s: a superseded copy of its %s task; nothing to do", revision, revision.state)
        return False
    revision.picked_up_at = now
    return True


def restore_begin(revision: AdapterRevision) -> bool:
    """A worker begins re-exporting an exported revision: record it, unless another re-export of it began less than
    `lost_after_s()` ago (it may still run; two would write over each other's staging files). False: leave it."""
    now = timezone.now()
    # Begun after the export was frozen (not the export's own start) and recently enough to be running still.
    running = Q(picked_up_at__gte=now - timedelta(seconds=lost_after_s()), picked_up_at__gt=F("exported_at"))
    if not AdapterRevision.objects.filter(id=revision.id).exclude(running).update(picked_up_at=now):
        log.info("%s: a re-export of it is running already", revision)
        return False
    revision.picked_up_at = now
    return True


def restore_end(revision: AdapterRevision, *, restored: bool) -> None:
    """A re-export ended (or hands over to its own retry): another may begin. A restored one gives its deliveries
    back (`export_redrive` counts them)."""
    fields = {"picked_up_at": None} | ({"deliveries": 0} if restored else {})
    AdapterRevision.objects.filter(id=revision.id, picked_up_at=revision.picked_up_at).update(**fields)


def export_redrive(*, revision: AdapterRevision, asked_at: datetime, now: datetime | None = None) -> str:
    """Send again the re-export serving asked for at `asked_at` (a rollback to `revision`, whose export was
    removed: `services.revision_ensure_export`) if it was lost: not begun MINT_TASK_PICKUP_S after it was sent,
    or begun and not back within `lost_after_s()`. Each re-send is a delivery of the revision (`dispatched_at` is
    when it was sent); past MINT_TASK_MAX_DELIVERIES it is given up (the rollback's prewarm then fails, naming the
    missing files). Idempotent; no probe here: a re-export that merely waited behind other work and runs twice
    runs once (`restore_begin`).

    Returns "complete" (nothing to do), "waiting" (its task may still start), "running", "sent" or "given_up".
    """
    if revision.state not in RESTORABLE_STATES or store.export_is_complete(revision):
        return "complete"
    now = now or timezone.now()

    def since_frozen(moment: datetime | None) -> datetime | None:  # not the export stage's own hand-off
        return (
            moment if moment is not None and (revision.exported_at is None or moment > revision.exported_at) else None
        )

    sent = max(asked_at, since_frozen(revision.dispatched_at) or asked_at)
    picked = since_frozen(revision.picked_up_at)
    if picked is not None and picked >= sent:
        if picked > now - timedelta(seconds=lost_after_s()):
            return "running"
    elif sent > now - handoffs.pickup():
        return "waiting"
    bound = settings.MINT_TASK_MAX_DELIVERIES
    if revision.deliveries >= bound:
        log.error("%s: its re-export was sent %s times and never finished; giving up", revision, revision.deliveries)
        return "given_up"
    moved = AdapterRevision.objects.filter(
        id=revision.id, deliveries=revision.deliveries, picked_up_at=revision.picked_up_at
    ).update(dispatched_at=now, picked_up_at=None, deliveries=F("deliveries") + 1)
    if not moved:
        return "running"  # another sweep, or a worker, got there first
    log.warning("%s: its re-export was lost; sent again (%s of %s)", revision, revision.deliveries + 1, bound)
    export_on_commit(revision)
    return "sent"


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


def _control_task(name: str) -> Task:
    """The task `adapters.tasks.<name>`, as Celery registered it (adapters.apps loads the module at start-up)."""
    return celery_app.tasks[f"adapters.tasks.{name}"]


def _send(revision_id: int, state: str, *, handed: datetime) -> None:
    """Put a hand-off on the broker; it carries its own time, so that a copy of an older one does nothing."""
    task = _control_task("revision_validate" if state == S.REGISTERED else "revision_export")
    task.delay(revision_id=revision_id, handed=handed.isoformat())


def export_on_commit(revision: AdapterRevision) -> None:
    """Send the revision's export once the surrounding transaction commits, without a hand-off of its own: it
    follows its validation in the place that had, or restores a removed export (`restore_begin`)."""
    transaction.on_commit(lambda: _control_task("revision_export").delay(revision_id=revision.id))


def dispatch_on_commit() -> None:
    """Dispatch once the surrounding transaction commits (a revision left the queue or joined it)."""
    transaction.on_commit(control_dispatch)
