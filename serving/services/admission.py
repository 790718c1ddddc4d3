"""Admission: which queued placements a node starts prewarming, and the bookkeeping of each prewarm's phases.

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
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from serving.models import ACTIVE_STATES, NodeState, Placement, PlacementState, PrewarmTurn, Priority, ServingNode
from serving.selectors.residency import on_demand_start_s, pause_left, pause_s
from serving.services import outbox, residency

log = logging.getLogger(__name__)
P = PlacementState
PACED_LATE_MAX_S = 5.0  # a paced load later than this past its pause waited for something else: not counted
REGISTERED_STATES = (P.LOADING, P.WARMING, P.READY, P.EVICTING)  # what the engine may hold under a LoRA name


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
        waits = {tenant: 0.0 for tenant in tenants} | {t.tenant_id: pause_left(t.resting_until, now) for t in history}
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
            outbox.placement_event(
                placement.id, state=P.LOADING, updated_at=now, revision=placement.revision, node=node
            )
        for placement_id in claimed:
            transaction.on_commit(
                lambda p=placement_id, q=node.queue: outbox.send("placement_prewarm", queue=q, placement_id=p)
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
    return pause_s(node.id, tenant_id, timezone.now())


def _rest(placement: Placement, *, busy_s: float, now: datetime) -> None:
    """Record the pause that a prewarm of `busy_s` seconds earns its tenant on the placement's node.

    Loads for requests (on demand) are paced at MINT_NODE_COLD_DUTY, the rest (activations, canaries) at
    MINT_NODE_PREWARM_DUTY, and loads on demand also at most MINT_NODE_COLD_LOADS_PER_MIN; neither when no other
    tenant used the node within MINT_NODE_PACING_NEIGHBOUR_S: pacing protects the others' requests, and with
    nobody else there it would only slow the tenant down."""
    tenant_id = placement.revision.adapter.tenant_id
    window = settings.MINT_NODE_PACING_NEIGHBOUR_S
    if placement.priority == Priority.COLD_REQUEST:
        _paced_late(placement, tenant_id, busy_s=busy_s, now=now)
    neighbours = (
        not window  # 0: always paced
        or Placement.objects.filter(node_id=placement.node_id, last_used_at__gte=now - timedelta(seconds=window))
        .exclude(revision__adapter__tenant_id=tenant_id)
        .exists()
    )
    duty = settings.MINT_NODE_PREWARM_DUTY
    if not neighbours:
        gap = 0.0
    elif placement.priority <= Priority.COLD_REQUEST:
        gap = on_demand_start_s(busy_s) - busy_s  # the same rule the refusals of paced asks count on
    else:
        gap = 0.0 if duty >= 1 else min(busy_s * (1 - duty) / duty, settings.MINT_NODE_PREWARM_MAX_GAP_S)
    PrewarmTurn.objects.update_or_create(
        node_id=placement.node_id,
        tenant_id=tenant_id,
        defaults={"resting_until": now + timedelta(seconds=gap)},
        create_defaults={"started_at": placement.started_at or now, "resting_until": now + timedelta(seconds=gap)},
    )


def _paced_late(placement: Placement, tenant_id: int, *, busy_s: float, now: datetime) -> None:
    """A load on demand queued before its tenant's last pause on the node ended (it waited for it) is ready now:
    how much later than that end plus its own `busy_s` is what pacing's estimates add to each paced load
    (`residency.paced_late_s`: the hand-offs around a load, admission after the pause)."""
    until = (
        PrewarmTurn.objects.filter(node_id=placement.node_id, tenant_id=tenant_id)
        .values_list("resting_until", flat=True)
        .first()
    )
    if until is None or placement.queued_at is None or placement.queued_at > until:
        return  # not held by a pause: nothing to learn about one
    late = (now - until).total_seconds() - busy_s
    if late < PACED_LATE_MAX_S:  # longer: the node was held by something else (an unload, another's load)
        residency.paced_late(node_id=placement.node_id, seconds=late)


def _admit_later_key(node_id: int) -> str:
    return f"serving:admit-later:{node_id}"


def _admit_later(node_id: int, delay: float) -> None:
    """Run admission for the node again once its pacing pause is over (once per pause, however often asked).

    The mark lives at least a second (the cache's resolution) but stands for one pause only:
    `admit_after_pause` clears it, or the next prewarm's pause, often shorter than a second,
    would find it and wait for nobody (until the heartbeat's reconcile admitted again).
    """
    if cache.add(_admit_later_key(node_id), 1, timeout=max(1, math.ceil(delay))):
        transaction.on_commit(lambda: outbox.send("node_admit", countdown=delay, node_id=node_id))


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
        outbox.placement_event(
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
        residency.ask_answered(placement=placement)
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
