"""What waits for room is placed when a slot frees, and pinned revisions short of their replicas are placed
again (failover); a revision nothing names any more leaves the nodes, freeing its slots.
"""

from __future__ import annotations

from collections import Counter

from django.db import transaction
from django.db.models import Count, F, OuterRef, Q, Subquery, Window
from django.db.models.functions import Coalesce, RowNumber
from django.utils import timezone

from adapters.models import AdapterRevision, RevisionState, replicas_sql
from serving import selectors
from serving.models import ACTIVE_STATES, HOLDING_STATES, NodeState, Placement, PlacementState, Priority, ServingNode
from serving.selectors.pins import PinRole, pinned_roles
from serving.services import outbox
from serving.services.admission import admit
from serving.services.placement import evict, place, placement_request

P = PlacementState


def placements_retry(*, base_model_id: int | None = None, limit: int = 200) -> dict[str, int]:
    """Place what waits for capacity, and make sure every pinned revision has a placement.

    Runs after a slot frees and on the heartbeat beat. Waiting placements whose revision no alias pins any
    more are dropped. The others are tried tenant by tenant in turn (the tenant holding the fewest slots
    first, each tenant's in priority order), and once one of a tenant's waits on a base model its others
    there are not tried this round (they would wait for the same reason): a tenant with many waiting costs
    one try per round, and cannot keep another's from being tried. A pinned, approved, exported revision
    with fewer placements on up nodes than its adapter's replica count (`Adapter.replica_count`; evicted for
    another tenant, every node was down, or its node went down) is requested again at activation priority:
    failover. Live revisions go first, then desired ones, then previous ones within their rollback grace
    (`PinRole`), and inside each, tenants take turns (`_failover_order`), so that `limit`, which
    bounds the requests of one round too, never spends a round on one tenant's many revisions while another
    tenant's live one waits. A routing canary's candidate that lost every placement is left for
    `canary.canaries_stranded_abort` to end, never placed again. Each try is its own transaction.
    """
    roles = pinned_roles(base_model_id=base_model_id)
    pins = {revision_id: tenant_id for revision_id, (tenant_id, _) in roles.items()}
    waiting = Placement.objects.filter(state=P.WAITING)
    if base_model_id is not None:
        waiting = waiting.filter(node__base_model_id=base_model_id)
    dropped, _ = waiting.exclude(revision_id__in=list(pins)).delete()
    held = Counter(
        Placement.objects.filter(state__in=HOLDING_STATES).values_list("revision__adapter__tenant_id", flat=True)
    )
    placed, stuck = 0, set()
    for row in _in_turns(waiting, held, limit=limit):
        adapter = row.revision.adapter
        if (adapter.tenant_id, adapter.base_model_id) in stuck:
            continue
        with transaction.atomic():
            locked = Placement.objects.select_for_update().filter(id=row.id, state=P.WAITING).first()
            if locked is None:
                continue
            result = place(row.revision, locked.priority, row=locked)
        if result is not None and result.state == P.QUEUED:
            placed += 1
        else:
            stuck.add((adapter.tenant_id, adapter.base_model_id))
    # Pinned revisions with fewer placement rows on up nodes than their replica count: evicted for another
    # tenant, never placed because every node was down, or on a node that went down. Rows in any state count
    # (waiting for room, being evicted, or failed: a failed prewarm is not retried by itself, or a bad one would
    # loop). Only ids here (every pinned revision after an outage): the chosen few are loaded below.
    # A revision holding a row on every up node of its base model cannot get another: not asked again each round
    # (its replica count may be above what is up).
    on_up_nodes = Q(placements__node__state=NodeState.UP)
    up_nodes = (
        ServingNode.objects.filter(base_model_id=OuterRef("adapter__base_model_id"), state=NodeState.UP)
        .values("base_model_id")
        .annotate(n=Count("id"))
        .values("n")
    )
    short = (
        AdapterRevision.objects.filter(id__in=list(pins), state=RevisionState.APPROVED)
        .exclude(export_uri="")
        .annotate(
            placed=Count("placements", filter=on_up_nodes),
            wanted=replicas_sql("adapter__"),
            nodes=Coalesce(Subquery(up_nodes), 0),
        )
        .filter(placed__lt=F("wanted"))
        .filter(placed__lt=F("nodes"))
        .values_list("id", flat=True)
    )
    # A routing canary's candidate that lost every placement is not placed again: the canary ends
    # (canary.canaries_stranded_abort), and a pin it no longer has would only hold a slot until then.
    stranded = set(
        selectors.stranded_canaries(base_model_id=base_model_id).values_list("canary_revision_id", flat=True)
    )
    short_ids = [r for r in short if not (r in stranded and roles[r][1] == PinRole.CANARY)]
    chosen = _failover_order(short_ids, roles, held)[:limit]
    revisions = AdapterRevision.objects.select_related("adapter__base_model", "adapter__tenant").in_bulk(chosen)
    for revision_id in chosen:
        revision = revisions[revision_id]
        placement_request(revision=revision, priority=Priority.ACTIVATION, replicas=revision.adapter.replica_count)
    return {"dropped": dropped, "placed": placed, "requested": len(chosen)}


def _failover_order(revision_ids: list[int], roles: dict[int, tuple[int, int]], held: Counter[int]) -> list[int]:
    """Pinned revisions in the order failover places them again: by role (live, desired, previous: `roles` from
    `selectors.pinned_roles`), and inside a role tenants in turn: each tenant's first, the tenant holding fewer
    slots first, then each one's second, and so on (each tenant's oldest revision first)."""
    turns: Counter[tuple[int, int]] = Counter()
    ranked = []
    for revision_id in sorted(revision_ids):
        tenant_id, role = roles[revision_id]
        turn = turns[(tenant_id, role)]
        turns[(tenant_id, role)] += 1
        ranked.append(((role, turn, held[tenant_id], tenant_id, revision_id), revision_id))
    return [revision_id for _, revision_id in sorted(ranked)]


def _in_turns(waiting, held: Counter[int], *, limit: int) -> list[Placement]:
    """Up to `limit` waiting placements, tenants taking turns: each tenant's first (highest priority, oldest),
    tenants holding fewer slots first, then each one's second, and so on."""
    ranked = waiting.annotate(
        turn=Window(
            RowNumber(),
            partition_by=[F("revision__adapter__tenant_id")],
            order_by=[F("priority").desc(), F("queued_at").asc(), F("id").asc()],
        )
    ).select_related("revision__adapter__tenant")
    rows = list(ranked.filter(turn__lte=max(1, limit // 4)).order_by("turn", "-priority", "queued_at")[: limit * 4])
    rows.sort(key=lambda p: (p.turn, -p.priority, held[p.revision.adapter.tenant_id], p.queued_at, p.id))
    return rows[:limit]


def placement_forget(*, placement: Placement) -> None:
    """Drop the bookkeeping of an unloaded placement, freeing its slot for what waits for one: a load queued for
    it (an eviction is decided for the load that needs its slot) is admitted first, then what waits is placed."""
    Placement.objects.filter(id=placement.id).delete()
    admit(node_id=placement.node_id)
    placements_retry(base_model_id=placement.node.base_model_id)


def placements_release(*, revision: AdapterRevision) -> dict[str, list[str]]:
    """Take a revision off the nodes (its alias was deactivated, or it was archived), whether or not it is pinned:
    the caller decided nothing names it any more. Placements holding no work (waiting, queued, failed) are withdrawn;
    ready ones are unloaded (`evict`, then the node agent's unload and its file cleanup after the grace); a load
    under way finishes first and is left for the caller's next call (serving.tasks.revision_leave_nodes tries
    again until none is left). Returns the nodes of each: {"withdrawn", "unloading", "loading"}."""
    with transaction.atomic():
        rows = list(
            Placement.objects.select_for_update(of=("self",))
            .filter(revision=revision)
            .select_related("node", "revision__adapter__tenant")
        )
        idle = [p for p in rows if p.state in (P.WAITING, P.QUEUED, P.FAILED)]
        Placement.objects.filter(id__in=[p.id for p in idle]).delete()
        now = timezone.now()
        for placement in idle:
            outbox.placement_event(
                placement.id, state="withdrawn", updated_at=now, revision=revision, node=placement.node
            )
        ready = [p for p in rows if p.state == P.READY]
        for placement in ready:
            evict(placement, reason=None)
        if idle:  # freed slots go to what waits for one
            base_model_id = revision.adapter.base_model_id
            transaction.on_commit(lambda: placements_retry(base_model_id=base_model_id))
    return {
        "withdrawn": sorted({p.node.name for p in idle}),
        "unloading": sorted({p.node.name for p in ready} | {p.node.name for p in rows if p.state == P.EVICTING}),
        "loading": sorted({p.node.name for p in rows if p.state in ACTIVE_STATES}),
    }
