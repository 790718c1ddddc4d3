"""Writes about placements (a revision on a node): requests, admission, prewarm bookkeeping, eviction, reconcile.

Admission holds the node row lock while it counts and claims, so the per-node limit
of cold loads (MINT_NODE_COLD_LOADS) holds however many workers claim at once;
queued placements are claimed with SKIP LOCKED in priority order. Prewarms are paced so
that one tenant's take at most MINT_NODE_PREWARM_DUTY of a node's time (rollbacks that need one too):
loads and warm-ups run on the engine that serves everyone else's requests. HTTP to vLLM never
happens inside these transactions: tasks call vLLM, then record the outcome here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Case, Count, DateTimeField, F, OuterRef, Q, Subquery, Value, When, Window
from django.db.models.functions import Coalesce, RowNumber
from django.utils import timezone

from adapters.models import AdapterRevision, RevisionState, replicas_sql
from mint_site.errors import Conflict
from mint_site.events import epoch_us, live_event
from serving import selectors, tasks
from serving.models import (
    ACTIVE_STATES,
    HOLDING_STATES,
    NodeState,
    Placement,
    PlacementState,
    PrewarmTurn,
    Priority,
    ServingNode,
    lora_name,
)
from serving.services import capacity, rendezvous, residency, sweep
from serving.services.nodes import node_set_state
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)
P = PlacementState
REGISTERED_STATES = (P.LOADING, P.WARMING, P.READY, P.EVICTING)  # what the engine may hold under a LoRA name


def _send(task, *, queue: str | None = None, countdown: float | None = None, **kwargs) -> None:
    """Enqueue a task of serving.tasks (a node's queue for node work), after the caller's commit."""
    task.apply_async(kwargs=kwargs, queue=queue, countdown=countdown)


# ---------------------------------------------------------------- placement and eviction


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


def _placement_event(
    placement_id: int,
    *,
    state: str,
    updated_at: datetime,
    revision: AdapterRevision,
    node: ServingNode,
    **fields: float | str | None,
) -> None:
    """Tell the revision's tenant (and staff) that a placement moved. `revision.adapter` must be loaded.

    `updated_us` is the `updated_at` the move wrote: events from different processes, and a page
    rendered meanwhile, can reach a browser out of order, and it drops what is older than it shows.
    """
    live_event(
        tenant_id=revision.adapter.tenant_id,
        type="placement.state",
        id=placement_id,
        state=state,
        updated_us=epoch_us(updated_at),
        adapter=revision.adapter.name,
        revision=f"r{revision.number}",
        node=node.name,
        **{name: value for name, value in fields.items() if value is not None},
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
            placed = _place(revision, priority, row=spare.pop(0) if spare else None)
            if placed is None or placed.state != P.QUEUED:
                break  # no room (it waits, or a cold request is refused): the next replica would not find any
        return holding[0] if holding else placed


def _place(revision: AdapterRevision, priority: int, *, row: Placement | None) -> Placement | None:
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
        if node_can_load(node, revision)
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
    pins = selectors.pinned_revisions(base_model_id=adapter.base_model_id)
    tenant_id = adapter.tenant_id

    def take(victim: Placement, reason: str | None = None) -> Placement:
        _evict(victim, reason=reason)
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
        )
        return row if decision.node is None else _carry_out(decision, row, revision, priority)
    if (node := _take_borrowed(locked)) is not None:
        return _queue(row, revision, node=node, priority=priority)
    if (decision := residency.make_room(order=order, pins=pins)).node is not None:
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
        _evict(victim, reason=None)
    if decision.view is not None:
        residency.save_segments(decision.view)
    return _queue(row, revision, node=decision.node, priority=priority)


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


def _queue(row: Placement | None, revision: AdapterRevision, *, node: ServingNode, priority: int) -> Placement:
    """Queue the revision on `node` for admission (a slot there is its own now)."""
    now = timezone.now()
    if row is None:
        row = Placement.objects.create(node=node, revision=revision, priority=priority, queued_at=now, updated_at=now)
    else:
        row.node, row.state, row.attempts, row.failure_reason = node, P.QUEUED, 0, ""
        row.priority, row.queued_at, row.updated_at = max(row.priority, priority), now, now
        row.save(update_fields=["node", "state", "attempts", "failure_reason", "priority", "queued_at", "updated_at"])
    _placement_event(row.id, state=P.QUEUED, updated_at=now, revision=revision, node=node)
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
    _placement_event(row.id, state=P.WAITING, updated_at=now, revision=revision, node=node, reason=reason)
    log.info("%s waits for capacity: %s", revision, reason)
    return row


def _evict(victim: Placement, *, reason: str | None) -> None:
    """Start unloading a ready placement to free its slot. A pinned one (`reason` says why it was chosen) is
    recorded in its tenant's audit log; `placements_retry` places its revision again when capacity frees."""
    now = timezone.now()
    Placement.objects.filter(id=victim.id, state=P.READY).update(state=P.EVICTING, updated_at=now)
    residency.record_eviction(node_name=victim.node.name)
    # Gateways stop routing to it now, not when their cached route expires.
    _placement_event(victim.id, state=P.EVICTING, updated_at=now, revision=victim.revision, node=victim.node)
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
    transaction.on_commit(lambda: _send(tasks.placement_unload, queue=victim.node.queue, placement_id=victim.id))


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
    (`selectors.PinRole`), and inside each, tenants take turns (`_failover_order`), so that `limit`, which
    bounds the requests of one round too, never spends a round on one tenant's many revisions while another
    tenant's live one waits. A routing canary's candidate that lost every placement is left for
    `canary.canaries_stranded_abort` to end, never placed again. Each try is its own transaction.
    """
    roles = selectors.pinned_roles(base_model_id=base_model_id)
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
            result = _place(row.revision, locked.priority, row=locked)
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
    short_ids = [r for r in short if not (r in stranded and roles[r][1] == selectors.PinRole.CANARY)]
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


def node_can_load(node: ServingNode, revision: AdapterRevision) -> bool:
    """Whether `node` runs with the engine flags and LoRA rank the revision's export needs (a packed MoE
    export needs `--enable-mixed-moe-lora-format` and a rank covering its stacked factors)."""
    record = revision.policy_record or {}
    missing = set(record.get("engine_flags") or ()) - set(node.engine_flags or ())
    return not missing and node.max_lora_rank >= int(record.get("min_max_lora_rank") or 0)


def admit(*, node_id: int) -> list[int]:
    """Start prewarming queued placements, up to the node's cold-load limit, fairly across tenants.

    The highest priority class goes first; inside it, tenants take turns (the one whose last prewarm on
    this node started longest ago goes next), and each tenant's prewarms are paced on their own
    (`prewarm_pacing_delay`): a tenant with hundreds queued delays another's one by at most one prewarm.
    """
    with transaction.atomic():
        node = ServingNode.objects.select_for_update().filter(id=node_id).first()
        if node is None or node.state != NodeState.UP:
            return []
        active = Placement.objects.filter(node=node, state__in=ACTIVE_STATES).count()
        # What vLLM holds registered (loads under way, ready, not yet unloaded) never passes its CPU LoRA cache:
        # a load whose slot an eviction frees waits for the unload, so the engine never pages adapters from disk
        # inside its step (every tenant's batch would wait for the read).
        registered = Placement.objects.filter(node=node, state__in=REGISTERED_STATES).count()
        free = min(settings.MINT_NODE_COLD_LOADS - active, node.cpu_slots - registered)
        if free <= 0:
            return []
        queued = list(
            Placement.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(node=node, state=P.QUEUED)
            .order_by("queued_at", "id")
            .values_list("id", "priority", "revision__adapter__tenant_id")
        )
        if not queued:
            return []
        tenants = {tenant for _, _, tenant in queued}
        now = timezone.now()
        history = PrewarmTurn.objects.filter(node=node, tenant_id__in=tenants)
        # When each tenant's last prewarm here started (none yet: its turn is first) and its pause left.
        turns = {t.tenant_id: t.started_at for t in history}
        waits = {tenant: 0.0 for tenant in tenants} | {t.tenant_id: _pause_left(t.resting_until, now) for t in history}
        claimed: list[int] = []
        for _ in range(free):
            ready = [q for q in queued if waits[q[2]] <= 0 and q[0] not in claimed]
            if not ready:
                break
            # Stable sort: inside a priority class and a tenant, the oldest queued goes first.
            placement_id, _, tenant = min(ready, key=lambda q: (-q[1], turns.get(q[2], _NEVER)))
            claimed.append(placement_id)
            turns[tenant] = now
        paused = [waits[t] for t in tenants if waits[t] > 0]
        if paused and len(claimed) < free:
            _admit_later(node.id, min(paused))
        if not claimed:
            return []
        Placement.objects.filter(id__in=claimed).update(
            state=P.LOADING, started_at=now, updated_at=now, attempts=F("attempts") + 1
        )
        PrewarmTurn.objects.bulk_create(
            [PrewarmTurn(node=node, tenant_id=t, started_at=now) for t in {q[2] for q in queued if q[0] in claimed}],
            update_conflicts=True,
            unique_fields=("node", "tenant"),
            update_fields=("started_at",),
        )
        for placement in Placement.objects.filter(id__in=claimed).select_related("revision__adapter"):
            _placement_event(placement.id, state=P.LOADING, updated_at=now, revision=placement.revision, node=node)
        for placement_id in claimed:
            transaction.on_commit(
                lambda p=placement_id, q=node.queue: _send(tasks.placement_prewarm, queue=q, placement_id=p)
            )
    return claimed


_NEVER = datetime.min.replace(tzinfo=UTC)


def prewarm_pacing_delay(node: ServingNode, *, tenant_id: int) -> float:
    """Seconds before `node` may start the tenant's next prewarm (0: now).

    A prewarm that kept the node busy for t seconds (fetch, verify and load, then the warm-up; a failed one
    from its start to its failure) is followed, for the same tenant, by a pause of t·(1-duty)/duty, at most
    MINT_NODE_PREWARM_MAX_GAP_S (`_rest`): a burst of one tenant's activations (or rollbacks that need a
    prewarm) takes at most MINT_NODE_PREWARM_DUTY of the engine's time, the requests it serves meanwhile keep
    their latency, and another tenant's prewarm does not wait behind that tenant's pauses.
    """
    until = PrewarmTurn.objects.filter(node=node, tenant_id=tenant_id).values_list("resting_until", flat=True).first()
    return _pause_left(until, timezone.now())


def _pause_left(until: datetime | None, now: datetime) -> float:
    if until is None or settings.MINT_NODE_PREWARM_DUTY >= 1:
        return 0.0
    return max(0.0, (until - now).total_seconds())


def _rest(placement: Placement, *, busy_s: float, now: datetime) -> None:
    """Record the pause that a prewarm of `busy_s` seconds earns its tenant on the placement's node.

    Loads for requests (on demand) are paced at MINT_NODE_COLD_DUTY, the rest (activations, canaries) at
    MINT_NODE_PREWARM_DUTY; neither when no other tenant used the node within MINT_NODE_PACING_NEIGHBOUR_S:
    pacing protects the others' requests, and with nobody else there it would only slow the tenant down."""
    tenant_id = placement.revision.adapter.tenant_id
    window = settings.MINT_NODE_PACING_NEIGHBOUR_S
    neighbours = (
        not window  # 0: always paced
        or Placement.objects.filter(node_id=placement.node_id, last_used_at__gte=now - timedelta(seconds=window))
        .exclude(revision__adapter__tenant_id=tenant_id)
        .exists()
    )
    duty = (
        settings.MINT_NODE_COLD_DUTY if placement.priority <= Priority.COLD_REQUEST else settings.MINT_NODE_PREWARM_DUTY
    )
    cap = settings.MINT_NODE_PREWARM_MAX_GAP_S
    gap = 0.0 if duty >= 1 or not neighbours else min(busy_s * (1 - duty) / duty, cap)
    PrewarmTurn.objects.update_or_create(
        node_id=placement.node_id,
        tenant_id=tenant_id,
        defaults={"resting_until": now + timedelta(seconds=gap)},
        create_defaults={"started_at": placement.started_at or now, "resting_until": now + timedelta(seconds=gap)},
    )


def _admit_later_key(node_id: int) -> str:
    return f"serving:admit-later:{node_id}"


def _admit_later(node_id: int, delay: float) -> None:
    """Run admission for the node again once its pacing pause is over (once per pause, however often asked).

    The mark lives at least a second (the cache's resolution) but stands for one pause only:
    `admit_after_pause` clears it, or the next prewarm's pause, often shorter than a second,
    would find it and wait for nobody (until the heartbeat's reconcile admitted again).
    """
    if cache.add(_admit_later_key(node_id), 1, timeout=max(1, math.ceil(delay))):
        transaction.on_commit(lambda: _send(tasks.node_admit, countdown=delay, node_id=node_id))


def admit_after_pause(*, node_id: int) -> list[int]:
    """Admission once a pacing pause is over (the `node_admit` task): the pause's mark goes first."""
    cache.delete(_admit_later_key(node_id))
    return admit(node_id=node_id)


def _move(placement: Placement, *, sources: tuple[str, ...], to: str, **fields) -> bool:
    now = timezone.now()
    moved = bool(
        Placement.objects.filter(id=placement.id, state__in=sources).update(state=to, updated_at=now, **fields)
    )
    if moved:
        placement.state, placement.updated_at = to, now
        for name, value in fields.items():
            setattr(placement, name, value)
        _placement_event(
            placement.id,
            state=to,
            updated_at=now,
            revision=placement.revision,
            node=placement.node,
            load_ms=placement.load_ms,
            warm_ms=placement.warm_ms,
        )
    return moved


def placement_loaded(*, placement: Placement, load_ms: float) -> bool:
    """Phase 1 done: the files are on the node, verified, and vLLM accepted them."""
    return _move(placement, sources=(P.LOADING,), to=P.WARMING, load_ms=load_ms, loaded_at=timezone.now())


def placement_warmed(*, placement: Placement, warm_ms: float) -> bool:
    """Phase 2 done: a real completion answered, the placement is routable. (`aliases.placement_ready` flips.)"""
    now = timezone.now()
    moved = _move(placement, sources=(P.WARMING,), to=P.READY, warm_ms=warm_ms, ready_at=now, last_used_at=now)
    if moved:
        _rest(placement, busy_s=((placement.load_ms or 0) + warm_ms) / 1000, now=now)
        if placement.priority == Priority.COLD_REQUEST:
            residency.cold_start_done(placement=placement, now=now)
        residency.record_load(placement=placement, now=now)
    return moved


def placement_failed(*, placement: Placement, reason: str) -> str:
    """A prewarm attempt failed: queue it again while attempts remain, else `failed` with the reason."""
    retry = placement.attempts < settings.MINT_PREWARM_ATTEMPTS
    to = P.QUEUED if retry else P.FAILED
    if _move(placement, sources=(P.LOADING, P.WARMING), to=to, failure_reason=reason[:2000]):
        now = timezone.now()
        _rest(placement, busy_s=(now - (placement.started_at or now)).total_seconds(), now=now)
    log.warning("prewarm of %s failed (attempt %s): %s", placement, placement.attempts, reason)
    admit(node_id=placement.node_id)
    return to


def placement_forget(*, placement: Placement) -> None:
    """Drop the bookkeeping of an unloaded placement, freeing its slot for what waits for one: a load queued for
    it (an eviction is decided for the load that needs its slot) is admitted first, then what waits is placed."""
    Placement.objects.filter(id=placement.id).delete()
    admit(node_id=placement.node_id)
    placements_retry(base_model_id=placement.node.base_model_id)


def placements_release(*, revision: AdapterRevision) -> dict[str, list[str]]:
    """Take a revision off the nodes (its alias was deactivated, or it was archived), whether or not it is pinned:
    the caller decided nothing names it any more. Placements holding no work (waiting, queued, failed) are withdrawn;
    ready ones are unloaded (`_evict`, then the node agent's unload and its file cleanup after the grace); a load
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
            _placement_event(placement.id, state="withdrawn", updated_at=now, revision=revision, node=placement.node)
        ready = [p for p in rows if p.state == P.READY]
        for placement in ready:
            _evict(placement, reason=None)
        if idle:  # freed slots go to what waits for one
            base_model_id = revision.adapter.base_model_id
            transaction.on_commit(lambda: placements_retry(base_model_id=base_model_id))
    return {
        "withdrawn": sorted({p.node.name for p in idle}),
        "unloading": sorted({p.node.name for p in ready} | {p.node.name for p in rows if p.state == P.EVICTING}),
        "loading": sorted({p.node.name for p in rows if p.state in ACTIVE_STATES}),
    }


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
        if placement is None or placement.revision_id in selectors.pinned_revisions():
            return False
        if placement.state in (P.QUEUED, P.WAITING, P.FAILED):
            placement.delete()
            return True
        if placement.state != P.READY:
            return False  # a load in progress finishes; then it is the first victim (eviction_victim)
        _evict(placement, reason=None)
    return True


def ready_count(revision: AdapterRevision) -> int:
    return Placement.objects.filter(revision=revision, state=P.READY, node__state=NodeState.UP).count()


# ---------------------------------------------------------------- drain


def node_drain(*, node: ServingNode, by: Actor, force: bool = False) -> dict[str, object]:
    """Start draining `node` (staff: `mint_node drain`, the API, the Nodes page) and take the first step."""
    if node.state == NodeState.DOWN:
        raise Conflict(f"Node {node.name} is down: there is nothing on it to move.", code="node_down")
    node_set_state(node=node, state=NodeState.DRAINING, by=by)
    node.refresh_from_db()
    placements_retry(base_model_id=node.base_model_id)  # place its pinned revisions elsewhere now
    return drain_step(node=node, force=force)


def drain_step(*, node: ServingNode, force: bool = False) -> dict[str, object]:
    """Move a draining node's revisions off it, without a gap: one step, run by `mint_node drain` and by each
    heartbeat while the node drains.

    A ready placement stays (and is routed to: serving.selectors.ready_placements) until its revision is
    ready on its adapter's replica count (`Adapter.replica_count`) of up nodes, or on every up node that can
    load it when there are fewer (at least one), or nothing pins it; then it is unloaded. The heartbeat's
    `placements_retry` places pinned revisions elsewhere meanwhile (a placement on a draining node does not
    count as one). Queued and waiting placements there are withdrawn; a load in
    progress finishes first.
    `force` unloads every ready placement at once (its aliases answer 503 until ready elsewhere).

    Returns what is left and why: {"left": n, "waiting": [reasons, one per revision that has no room]}.
    """
    if node.state != NodeState.DRAINING:
        return {"left": 0, "waiting": []}
    pins = selectors.pinned_revisions(base_model_id=node.base_model_id)
    with transaction.atomic():
        rows = list(
            Placement.objects.select_for_update(of=("self",))
            .filter(node=node)
            .exclude(state=P.EVICTING)
            .select_related("revision__adapter__tenant", "node")
        )
        Placement.objects.filter(id__in=[p.id for p in rows if p.state in (P.QUEUED, P.WAITING, P.FAILED)]).delete()
        ready = [p for p in rows if p.state == P.READY]
        elsewhere = Counter(
            Placement.objects.filter(
                revision_id__in=[p.revision_id for p in ready], state=P.READY, node__state=NodeState.UP
            ).values_list("revision_id", flat=True)
        )
        # Up nodes of the base model: a revision needs its replica count there, or as many as can load it (two
        # nodes and two replicas: draining one leaves one replica, on the other, rather than no drain at all).
        others = list(ServingNode.objects.filter(base_model_id=node.base_model_id, state=NodeState.UP))
        staying = []
        for placement in ready:
            room = sum(node_can_load(other, placement.revision) for other in others)
            needed = max(1, min(placement.revision.adapter.replica_count, room))
            if force or placement.revision_id not in pins or elsewhere[placement.revision_id] >= needed:
                _evict(placement, reason=None)
            else:
                staying.append(placement)
        # Each staying revision's placement on its way elsewhere, if any: one waiting for room says why.
        underway = {
            revision_id: (state, reason)
            for revision_id, state, reason in Placement.objects.filter(
                revision_id__in=[p.revision_id for p in staying], node__state=NodeState.UP
            )
            .exclude(state=P.READY)
            .order_by("-id")
            .values_list("revision_id", "state", "failure_reason")
        }
        waiting = []
        for placement in staying:
            label = f"{placement.revision.adapter.name}@r{placement.revision.number}"
            state, reason = underway.get(placement.revision_id, (None, ""))
            if state is None:
                waiting.append(f"{label}: not placed elsewhere yet")
            elif state == P.WAITING:
                waiting.append(f"{label}: {reason}")
    return {"left": Placement.objects.filter(node=node).count(), "waiting": waiting}


# ---------------------------------------------------------------- reconcile


def node_reconcile(*, node: ServingNode, loaded: set[str], seen_at: datetime | None = None) -> dict[str, int]:
    """Make the records of an up node match what its vLLM really holds (`loaded`, as read at `seen_at`).

    A placement marked ready or warming whose LoRA name vLLM no longer lists was lost
    (the engine restarted): live and desired revisions are queued again to be
    re-prewarmed, unless they hold their replica count on other up nodes already (placed
    there while this node was down); others are forgotten. A load stuck past MINT_PREWARM_TIMEOUT_S from when
    its agent began it (its agent died), or from its claim if no agent began it (its task
    was lost with the broker and no probe came back: serving/services/sweep.py), is queued
    again while it has attempts left (MINT_PREWARM_ATTEMPTS), else it fails: a load that
    kills its agent cannot come back forever. An eviction whose unload task was lost is
    finished: forgotten when vLLM no longer lists the LoRA, else its unload is sent again
    once it is overdue, counted the same way (`sweep.handoffs_overdue`).
    """
    protected = selectors.protected_revision_ids()
    requeued = forgotten = failed = resent = 0
    now = timezone.now()
    placements = Placement.objects.filter(node=node).select_related("revision__adapter__tenant")
    with transaction.atomic():
        # A load that finished after `loaded` was read is not in it, and is not lost: with loads on demand every
        # second or so, a heartbeat would otherwise forget what the agent had just loaded (and then unload it as a
        # stray), leaving the request that asked for it to time out.
        lost = [
            placement
            for placement in placements.filter(state__in=(P.READY, P.WARMING)).select_for_update(of=("self",))
            if lora_name(placement.revision) not in loaded
            and not (seen_at is not None and placement.loaded_at is not None and placement.loaded_at >= seen_at)
        ]
        # While the node was away its revisions were placed elsewhere (failover): one that holds its replica
        # count on other up nodes is not loaded here again.
        elsewhere = Counter(
            Placement.objects.filter(
                revision_id__in=[p.revision_id for p in lost],
                state__in=(P.QUEUED, P.LOADING, P.WARMING, P.READY),
                node__state=NodeState.UP,
            )
            .exclude(node=node)
            .values_list("revision_id", flat=True)
        )
        for placement in lost:
            if (
                placement.revision_id in protected
                and elsewhere[placement.revision_id] < placement.revision.adapter.replica_count
            ):
                Placement.objects.filter(id=placement.id).update(
                    state=P.QUEUED,
                    attempts=0,
                    priority=max(placement.priority, Priority.ACTIVATION),
                    queued_at=now,
                    updated_at=now,
                    failure_reason="lost by the engine (restart)",
                )
                _placement_event(placement.id, state=P.QUEUED, updated_at=now, revision=placement.revision, node=node)
                requeued += 1
            else:
                placement.delete()
                forgotten += 1
        evicting = list(placements.filter(state=P.EVICTING).select_for_update(of=("self",)))
        gone = [p.id for p in evicting if lora_name(p.revision) not in loaded]
        forgotten += Placement.objects.filter(id__in=gone).delete()[0]
        again = sweep.handoffs_overdue(node, now=now)
        requeued, failed = requeued + again["requeued"], again["failed"]
        resent, forgotten = again["unloads_resent"], forgotten + again["forgotten"]
    admit(node_id=node.id)
    return {"requeued": requeued, "forgotten": forgotten, "failed": failed, "unloads_resent": resent}


# ---------------------------------------------------------------- use (from the gateway)

_TOUCH_CHUNK = 500


def placements_touch(*, used: dict[int, datetime]) -> int:
    """Record when placements last answered a request (eviction is LRU on it): one UPDATE per chunk of ids,
    `SET last_used_at = CASE id WHEN … END`, which also moves an on-demand placement served again from probation
    to protected (serving/residency/policy.py). The gateway batches uses and calls this from a database thread."""
    ids = sorted(used)
    written = 0
    for start in range(0, len(ids), _TOUCH_CHUNK):
        chunk = ids[start : start + _TOUCH_CHUNK]
        value = Case(*(When(id=i, then=Value(used[i])) for i in chunk), output_field=DateTimeField())
        written += Placement.objects.filter(id__in=chunk).update(last_used_at=value, segment=residency.promoted())
    return written
