"""Serving work whose task was lost is driven again: prewarms and unloads on the node queues, the convergence of
aliases, and a rollback's re-export. The database is the source of truth; Redis may lose every task it holds
(a restart without persistence), and what waits on such a task is found here by the heartbeat.

A node agent records when it begins a prewarm or an unload (`Placement.picked_up_at`; `prewarm_begin`,
`unload_begin`), so a hand-off nobody has begun (a prewarm claimed at `started_at`, an unload sent at
`updated_at`) is told apart from one that may still run. A hand-off that has waited MINT_TASK_PICKUP_S unbegun
gets a probe sent behind it on its node's queue (`probe_node_queue`); the queue is first in, first out, so when the
agent takes the probe it has taken everything sent before, and what is still unbegun then was lost
(`node_queue_probed`). An agent that is merely down takes neither: nothing is counted while it is away. Begun work is
driven again only past MINT_PREWARM_TIMEOUT_S (`handoffs_overdue`, from node_reconcile), as is work that never
began while no probe came back.

Driven again means counted. A prewarm goes back to admission, whose next claim counts an attempt; past
MINT_PREWARM_ATTEMPTS it fails. An unload is sent again, counted in `attempts` from the first re-send (which
records when it was sent in `started_at`: the load's own start precedes `ready_at`); past the same bound the
placement is dropped, its slot freed (vLLM may still list the name; the files under it stay).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, F, Max, Q, QuerySet, When
from django.utils import timezone

from adapters import dispatch as control_queue
from adapters import handoffs
from adapters.models import AdapterRevision
from serving.models import Alias, NodeState, Placement, PlacementState, ServingNode
from serving.services import aliases, outbox
from serving.services.admission import admit

log = logging.getLogger(__name__)
P = PlacementState


def _unbegun_before(node: ServingNode, before: datetime) -> QuerySet[Placement]:
    """The node's prewarms claimed and unloads sent before `before` that its agent has not begun."""
    return Placement.objects.filter(node=node).filter(
        (Q(state=P.LOADING) & handoffs.unbegun("started_at", before=before))
        | (Q(state=P.EVICTING) & handoffs.unbegun("updated_at", before=before))
    )


def prewarm_begin(placement: Placement) -> bool:
    """The node agent begins the prewarm of a claimed placement: record it. False if this claim was begun already
    (a second copy of its task: the broker's redelivery, or a copy sent again after the first was presumed lost),
    so one claim never runs twice at once; a begun prewarm that never ends is node_reconcile's, past
    MINT_PREWARM_TIMEOUT_S."""
    now = timezone.now()
    begun = (
        Placement.objects.filter(id=placement.id, state=P.LOADING, started_at=placement.started_at)
        .filter(handoffs.unbegun("started_at"))
        .update(picked_up_at=now)
    )
    if begun:
        placement.picked_up_at = now
    return bool(begun)


def unload_begin(placement: Placement) -> None:
    """The node agent begins an unload: record it (an unload may run twice; vLLM forgets a name once)."""
    Placement.objects.filter(id=placement.id, state=P.EVICTING).update(picked_up_at=timezone.now())


def probe_node_queue(*, node: ServingNode, now: datetime | None = None) -> bool:
    """Heartbeat: send a probe on the node's queue behind hand-offs that have waited MINT_TASK_PICKUP_S unbegun.

    It expires after that long: probes sent while the agent is down do not pile up for it.
    """
    now = now or timezone.now()
    if not _unbegun_before(node, now - handoffs.pickup()).exists():
        return False
    outbox.send(
        "node_queue_probe",
        queue=node.queue,
        expires=settings.MINT_TASK_PICKUP_S,
        node_id=node.id,
        sent_at=now.isoformat(),
    )
    return True


def node_queue_probed(*, node_id: int, passed_before: datetime) -> dict[str, int]:
    """The node's agent took a probe sent at `passed_before`: it has taken every task sent before, so its
    hand-offs sent MINT_TASK_PICKUP_S before that and still unbegun were lost. They are driven again."""
    node = ServingNode.objects.filter(id=node_id).first()
    if node is None:
        return {}
    with transaction.atomic():
        # Unloads locked first, as node_reconcile locks them before loads: the two never wait on each other.
        lost = list(
            _unbegun_before(node, passed_before - handoffs.pickup())
            .select_for_update(of=("self",))
            .select_related("revision__adapter", "node")
            .order_by(Case(When(state=P.EVICTING, then=0), default=1), "id")
        )
        result = handoffs_again(node, lost, now=timezone.now(), why="its task was lost before the node agent began it")
    admit(node_id=node.id)
    if any(result.values()):
        log.warning("%s: hand-offs lost with the broker, driven again: %s", node, result)
    return result


def handoffs_overdue(node: ServingNode, *, now: datetime) -> dict[str, int]:
    """Drive again the node's prewarms and unloads that did not end within MINT_PREWARM_TIMEOUT_S of when they
    began (their agent died, or the task was lost with the broker and no probe came back), counted. Call inside
    a transaction (node_reconcile)."""
    stuck = now - timedelta(seconds=settings.MINT_PREWARM_TIMEOUT_S)
    begun_loads = Q(picked_up_at__gte=F("started_at"), picked_up_at__lt=stuck)
    overdue = Placement.objects.filter(node=node).filter(
        (Q(state=P.LOADING) & handoffs.overdue("started_at", before=stuck))
        # Warming: phase 1 ended in the agent that began it; it may have died before the warm-up answered.
        | (Q(state=P.WARMING) & (begun_loads | Q(picked_up_at__isnull=True, started_at__lt=stuck)))
        | (Q(state=P.EVICTING) & handoffs.overdue("updated_at", before=stuck))
    )
    rows = list(overdue.select_for_update(of=("self",)).select_related("revision__adapter", "node"))
    return handoffs_again(node, rows, now=now, why="prewarm timed out")


def handoffs_again(node: ServingNode, rows: list[Placement], *, now: datetime, why: str) -> dict[str, int]:
    """Drive each locked prewarm or unload again, counted; past MINT_PREWARM_ATTEMPTS a prewarm fails and an
    unload is given up (the placement is dropped). Inside the caller's transaction; admission is the caller's."""
    bound = settings.MINT_PREWARM_ATTEMPTS
    result = {"requeued": 0, "failed": 0, "unloads_resent": 0, "forgotten": 0}
    for placement in rows:
        if placement.state == P.EVICTING:
            _unload_again(node, placement, now=now, bound=bound, result=result)
            continue
        spent = placement.attempts >= bound
        to = P.FAILED if spent else P.QUEUED
        reason = f"{why} ({placement.attempts} attempts)" if spent else why
        Placement.objects.filter(id=placement.id).update(state=to, updated_at=now, failure_reason=reason)
        outbox.placement_event(placement.id, state=to, updated_at=now, revision=placement.revision, node=node)
        result["failed" if spent else "requeued"] += 1
    return result


def _unload_again(node: ServingNode, placement: Placement, *, now: datetime, bound: int, result: dict) -> None:
    # Sent again before: a re-send records its time in `started_at`, which the load's own start precedes.
    resent = (
        placement.started_at is not None
        and placement.ready_at is not None
        and placement.started_at > placement.ready_at
    )
    sends = (placement.attempts if resent else 1) + 1
    if sends > bound:
        log.warning("unload of %s on %s never finished after %s sends; dropping the placement", placement, node, bound)
        Placement.objects.filter(id=placement.id).delete()
        result["forgotten"] += 1
        return
    Placement.objects.filter(id=placement.id).update(started_at=now, updated_at=now, attempts=sends)
    transaction.on_commit(lambda p=placement.id: outbox.send("placement_unload", queue=node.queue, placement_id=p))
    result["unloads_resent"] += 1


# ---------------------------------------------------------------- aliases


def aliases_sweep(*, limit: int = 100) -> dict[str, int]:
    """Heartbeat: aliases still pending whose convergence task was lost. One whose desired revision is ready
    flips (`aliases.converge_aliases` checks the replicas); a rollback whose re-export was lost has it sent
    again (`adapters.dispatch.export_redrive`, counted; once per target revision, however many aliases). A
    desired revision with no placement is `placements_retry`'s; a queued one, admission's."""
    pending = Alias.objects.filter(desired_revision__isnull=False).filter(
        Q(revision__isnull=True) | ~Q(desired_revision_id=F("revision_id"))
    )
    ready = list(
        pending.filter(
            desired_revision__placements__state=P.READY, desired_revision__placements__node__state=NodeState.UP
        )
        .values_list("desired_revision_id", flat=True)
        .distinct()[:limit]
    )
    flipped = 0
    for revision in AdapterRevision.objects.filter(id__in=ready).select_related("adapter__tenant"):
        flipped += len(aliases.converge_aliases(revision=revision))
    # Once per rollback target, however many aliases roll back to it (each check reads the artifact store), asked
    # at the latest of their rollbacks: a re-export sent then is the one that may have been lost.
    asked = dict(
        pending.filter(rollback_pending=True)
        .exclude(desired_revision_id__in=ready)
        .values("desired_revision_id")
        .annotate(asked_at=Max("updated_at"))
        .order_by("desired_revision_id")
        .values_list("desired_revision_id", "asked_at")[:limit]
    )
    reexports = 0
    for revision in AdapterRevision.objects.filter(id__in=asked).select_related("adapter__tenant"):
        with transaction.atomic():
            outcome = control_queue.export_redrive(revision=revision, asked_at=asked[revision.id])
        reexports += outcome == "sent"
    return {"flipped": flipped, "reexports_sent": reexports}
