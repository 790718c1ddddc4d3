"""Where a revision goes: placement requests, finding room on a node (its rendezvous home, the residency
policy, the tenants' fair shares) and eviction. Admission then starts the loads (serving/services/admission.py);
what waits for room is placed again when a slot frees (serving/services/failover.py).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Count, F, Value, When
from django.utils import timezone

from adapters.models import AdapterRevision
from serving import selectors
from serving.models import HOLDING_STATES, NodeState, Placement, PlacementState, Priority, ServingNode, lora_name
from serving.selectors.pins import pinned_revisions, pins_and_activations
from serving.services import capacity, outbox, rendezvous, residency
from serving.services.admission import admit
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)
P = PlacementState


def eviction_victim(
    nodes: ServingNode | list[ServingNode], *, protected: set[int], tenant_id: int | None = None
) -> Placement | None:
    """The least recently used ready placement on `nodes` whose revision is not protected (of one tenant's
    placements only, when `tenant_id` is given), with its node and tenant. Speculative placements (an
    evaluation's: serving/services/evaluation.py) go first: they only ever borrow a slot nobody needed."""
    nodes = [nodes] if isinstance(nodes, ServingNode) else nodes
    victims = Placement.objects.filter(node__in=nodes, state=P.READY).exclude(revision_id__in=protected)
    if tenant_id is not None:
        victims = victims.filter(revision__adapter__tenant_id=tenant_id)
    speculative_first = Case(When(priority=Priority.SPECULATIVE, then=Value(0)), default=Value(1))
    return (
        victims.select_related("revision__adapter__tenant", "node")
        .order_by(speculative_first, F("last_used_at").asc(nulls_first=True), "ready_at", "id")
        .first()
    )


def placement_request(*, revision: AdapterRevision, priority: int, replicas: int = 1) -> Placement | None:
    """Ask for `revision` to be loaded on `replicas` distinct nodes of its base model. Never waits for a load.

    Returns a placement of it, existing or new (existing ones keep the higher priority): `queued` for
    admission when a slot is free or may be taken under the capacity rules (serving/services/capacity.py);
    for a pinned revision (an alias names it) that finds no room, `waiting` with its reason, placed by
    `placements_retry` when capacity frees. None for a cold request that finds no room (the caller's 503
    asks it to come back) and when no node of the base model can load the revision. Each replica goes to the
    first node of the revision's rendezvous order with room that holds none of it yet; a placement on a node
    that is down holds nothing (failover places the revision again elsewhere).
    """
    with transaction.atomic():
        rows = list(
            Placement.objects.select_for_update(of=("self",))
            .filter(revision=revision)
            .exclude(state=P.EVICTING)
            .select_related("node")
            .order_by("id")
        )
        holding = [p for p in rows if p.state not in (P.FAILED, P.WAITING) and p.node.state == NodeState.UP]
        for existing in holding:
            if existing.priority < priority:
                existing.priority, existing.updated_at = priority, timezone.now()
                existing.save(update_fields=["priority", "updated_at"])
            if existing.state == P.QUEUED:
                transaction.on_commit(lambda node_id=existing.node_id: admit(node_id=node_id))
        # Failed and waiting rows are reused (waiting ones first); a row on a node that went down stays where it
        # is, for the heartbeat's reconcile to settle if the node comes back.
        spare = sorted(
            (p for p in rows if p.state in (P.FAILED, P.WAITING)), key=lambda p: (p.state != P.WAITING, p.id)
        )
        placed = None
        for _ in range(replicas - len(holding)):
            placed = place(revision, priority, row=spare.pop(0) if spare else None)
            if placed is None or placed.state != P.QUEUED:
                break  # no room (it waits, or a cold request is refused): the next replica would not find any
        return holding[0] if holding else placed


def placement_turn(*, revision_id: int) -> Placement | None:
    """Ask again for a revision whose request was refused on demand, when the turn it waits for ends, the entry it
    waits for should free, or its tenant's pacing lets its load start (the `residency_turn` task;
    serving/services/residency.py): its load starts then, not when its client comes back. Nothing when the ask no
    longer waits (placed meanwhile, or given up)."""
    revision = AdapterRevision.objects.select_related("adapter").filter(id=revision_id).first()
    if revision is None:
        return None
    if not residency.turn_due(revision):
        return None
    with residency.asked_again():
        return placement_request(revision=revision, priority=Priority.COLD_REQUEST)


def place(revision: AdapterRevision, priority: int, *, row: Placement | None) -> Placement | None:
    """Find room for a revision (inside the caller's transaction) and queue it there, or make it wait.

    `row` is the revision's existing placement that is not holding a slot (failed, waiting, or on a node
    that went down), reused rather than duplicated.
    """
    adapter = revision.adapter
    if row is not None and row.state == P.FAILED and priority < Priority.ACTIVATION:
        backoff = timedelta(seconds=settings.MINT_PLACEMENT_FAILED_BACKOFF_S)
        if row.updated_at > timezone.now() - backoff:
            return row  # cold requests do not re-queue a load that just failed every attempt
    others = Placement.objects.filter(revision=revision).exclude(id=row.id if row else None)
    eligible = [
        node
        for node in ServingNode.objects.filter(base_model_id=adapter.base_model_id).exclude(
            id__in=others.values("node_id")
        )
        if selectors.node_can_load(node, revision)
    ]
    up = [node for node in eligible if node.state == NodeState.UP]
    if not up:
        # A revision short of replicas on a fleet with fewer nodes up asks again every heartbeat: quietly.
        log.log(
            logging.DEBUG if others.exists() else logging.WARNING,
            "no other up node serves %s for %s (or none has the flags and rank it needs)",
            adapter.base_model,
            revision,
        )
        if row is None or row.state != P.WAITING or not eligible:
            return row
        return _wait(row, revision, node=eligible[0], priority=priority, reason="no node of the base model is up")
    # Locked in id order, so that two requests never wait on each other's nodes.
    locked = list(ServingNode.objects.select_for_update().filter(id__in=[n.id for n in up]).order_by("id"))
    holding = dict(
        Placement.objects.filter(node__in=locked, state__in=HOLDING_STATES)
        .values_list("node_id")
        .annotate(n=Count("id"))
        .values_list("node_id", "n")
    )
    # The revision's home: the first node in its rendezvous order with a free slot (serving/services/rendezvous.py),
    # so that nodes joining or leaving move only about their share of revisions.
    order = rendezvous.preference(lora_name(revision), locked)
    if (home := next((n for n in order if holding.get(n.id, 0) < n.cpu_slots), None)) is not None:
        return _queue(row, revision, node=home, priority=priority)
    if priority == Priority.SPECULATIVE:
        return row  # speculative (an evaluation): only a free slot, never an eviction
    pins, activating = pins_and_activations(base_model_id=adapter.base_model_id)
    tenant_id = adapter.tenant_id

    def take(victim: Placement, reason: str | None = None) -> Placement:
        evict(victim, reason=reason)
        return _queue(row, revision, node=victim.node, priority=priority)

    if revision.id not in pins:
        # An evaluation's queued slot goes to its own tenant's loads on demand, to anyone's pins (below).
        if (node := _take_borrowed(locked, tenant_id=tenant_id)) is not None:
            return _queue(row, revision, node=node, priority=priority)
        # On demand (a request for a live revision loaded nowhere, or a pinned `@rN`): the residency policy picks
        # the node and what leaves (serving/services/residency.py); nothing pinned ever does. No room (all busy):
        # the caller answers 503 with Retry-After and asks again.
        decision = residency.on_demand(
            revision_id=revision.id,
            tenant_id=tenant_id,
            order=order,
            held=holding,
            pins=pins,
            on_disk=residency.disk_nodes(revision.id),
            activating=activating,
        )
        if decision.node is not None:
            return _carry_out(decision, row, revision, priority)
        if (countdown := decision.ask_again_s) is not None:  # its load starts when the turn it waits for ends
            transaction.on_commit(lambda: outbox.send("residency_turn", countdown=countdown, revision_id=revision.id))
        return row
    if (node := _take_borrowed(locked)) is not None:
        return _queue(row, revision, node=node, priority=priority)
    # An on-demand alias's activation makes room within its tenant's cap; a reserved pin outranks the cache.
    activation = tenant_id if revision.id in activating else None
    decision = residency.make_room(order=order, pins=pins, activating=activating, tenant_id=activation)
    if decision.node is not None:
        return _carry_out(decision, row, revision, priority)
    shares = capacity.shares(base_model_id=adapter.base_model_id, requester=tenant_id, pins=pins)
    if shares.may_take(tenant_id):
        for over in shares.over(besides=tenant_id):
            if (victim := eviction_victim(locked, protected=set(), tenant_id=over)) is not None:
                slug = victim.revision.adapter.tenant.slug
                return take(victim, f"evicted for a tenant under its fair share: {shares.describe(over, slug)}")
    reason = f"waiting for a free slot: {shares.describe(tenant_id, adapter.tenant.slug)}"
    return _wait(row, revision, node=order[0], priority=priority, reason=reason)


def _carry_out(decision: residency.Decision, row: Placement | None, revision: AdapterRevision, priority: int):
    """Evict what the residency policy chose, record the segments it moved, and queue the revision there."""
    for victim in decision.evict:
        evict(victim, reason=None)
    if decision.view is not None:
        residency.save_segments(decision.view)
    segment = residency.segment_of(decision, revision.id)
    return _queue(row, revision, node=decision.node, priority=priority, segment=segment)


def _take_borrowed(nodes: list[ServingNode], *, tenant_id: int | None = None) -> ServingNode | None:
    """Withdraw a speculative placement still queued on `nodes` (an evaluation's, not loading yet: nothing to
    unload) and return its node, whose slot is the caller's now; None when there is none. An evaluation only
    borrows free slots, even before it holds one; its runner finds the row gone and asks again."""
    borrowed = Placement.objects.filter(node__in=nodes, state=P.QUEUED, priority=Priority.SPECULATIVE)
    if tenant_id is not None:
        borrowed = borrowed.filter(revision__adapter__tenant_id=tenant_id)
    placement = borrowed.select_related("node").order_by("queued_at", "id").first()
    if placement is None:
        return None
    node = placement.node
    log.info("placement %s (speculative, queued) withdrawn: its slot on %s is needed", placement.id, node.name)
    placement.delete()
    return node


def _queue(
    row: Placement | None, revision: AdapterRevision, *, node: ServingNode, priority: int, segment: str = "window"
) -> Placement:
    """Queue the revision on `node` for admission (a slot there is its own now), in the residency `segment` it
    enters (the window, but for a turn taken in main: serving/residency/policy.py)."""
    now = timezone.now()
    if row is None:
        row = Placement.objects.create(
            node=node, revision=revision, priority=priority, queued_at=now, updated_at=now, segment=segment
        )
    else:
        row.node, row.state, row.attempts, row.failure_reason = node, P.QUEUED, 0, ""
        row.priority, row.queued_at, row.updated_at, row.segment = max(row.priority, priority), now, now, segment
        fields = ["node", "state", "attempts", "failure_reason", "priority", "queued_at", "updated_at", "segment"]
        row.save(update_fields=fields)
    outbox.placement_event(row.id, state=P.QUEUED, updated_at=now, revision=revision, node=node)
    transaction.on_commit(lambda: admit(node_id=node.id))
    return row


def _wait(row: Placement | None, revision: AdapterRevision, *, node: ServingNode, priority: int, reason: str):
    """Keep a pinned revision waiting for capacity, with the reason people see; `placements_retry` places it."""
    now = timezone.now()
    if row is None:
        row = Placement.objects.create(
            node=node,
            revision=revision,
            state=P.WAITING,
            priority=priority,
            failure_reason=reason,
            queued_at=now,
            updated_at=now,
        )
    else:
        fresh = row.state != P.WAITING
        row.node, row.state, row.failure_reason, row.updated_at = node, P.WAITING, reason, now
        row.priority = max(row.priority, priority)
        if fresh:
            row.attempts, row.queued_at = 0, now
        row.save(update_fields=["node", "state", "failure_reason", "priority", "attempts", "queued_at", "updated_at"])
    outbox.placement_event(row.id, state=P.WAITING, updated_at=now, revision=revision, node=node, reason=reason)
    log.info("%s waits for capacity: %s", revision, reason)
    return row


def evict(victim: Placement, *, reason: str | None) -> None:
    """Start unloading a ready placement to free its slot. A pinned one (`reason` says why it was chosen) is
    recorded in its tenant's audit log; `placements_retry` places its revision again when capacity frees."""
    now = timezone.now()
    Placement.objects.filter(id=victim.id, state=P.READY).update(state=P.EVICTING, updated_at=now)
    residency.record_eviction(node_name=victim.node.name)
    # Gateways stop routing to it now, not when their cached route expires.
    outbox.placement_event(victim.id, state=P.EVICTING, updated_at=now, revision=victim.revision, node=victim.node)
    if reason is not None:
        adapter = victim.revision.adapter
        log.warning("evicting pinned %s from %s: %s", victim.revision, victim.node, reason)
        audit_record(
            tenant=adapter.tenant,
            actor=Actor.system(),
            action="placement.evict",
            target=f"revision:{adapter.name}:r{victim.revision.number}",
            before={"node": victim.node.name, "state": P.READY},
            after={"state": P.EVICTING, "reason": reason},
        )
    transaction.on_commit(lambda: outbox.send("placement_unload", queue=victim.node.queue, placement_id=victim.id))


def placement_release_speculative(*, placement_id: int) -> bool:
    """Give back the slot an evaluation borrowed: unload its placement if it is still only speculative (no
    cold request or activation raised its priority, and no alias pinned the revision meanwhile); a queued
    one is withdrawn. True if released."""
    with transaction.atomic():
        placement = (
            Placement.objects.select_for_update(of=("self",))
            .select_related("revision__adapter__tenant", "node")
            .filter(id=placement_id, priority=Priority.SPECULATIVE)
            .first()
        )
        if placement is None or placement.revision_id in pinned_revisions():
            return False
        if placement.state in (P.QUEUED, P.WAITING, P.FAILED):
            placement.delete()
            return True
        if placement.state != P.READY:
            return False  # a load in progress finishes; then it is the first victim (eviction_victim)
        evict(placement, reason=None)
    return True


def placements_withdraw(revision: AdapterRevision) -> list[str]:
    """Delete the revision's waiting and queued placements if no alias pins it any more (a cancelled activation,
    an aborted canary); the nodes they were on. Inside the caller's transaction."""
    if revision.id in pinned_revisions(base_model_id=revision.adapter.base_model_id):
        return []
    rows = list(
        Placement.objects.select_for_update(of=("self",))
        .filter(revision=revision, state__in=(P.WAITING, P.QUEUED))
        .select_related("node")
    )
    if not rows:
        return []
    Placement.objects.filter(id__in=[p.id for p in rows]).delete()
    now = timezone.now()
    for placement in rows:
        outbox.placement_event(placement.id, state="withdrawn", updated_at=now, revision=revision, node=placement.node)
    return sorted({p.node.name for p in rows})
