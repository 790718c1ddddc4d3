"""Writes about placements (a revision on a node): requests, admission, prewarm bookkeeping, eviction, reconcile.

Admission holds the node row lock while it counts and claims, so the per-node limit
of cold loads (MINT_NODE_COLD_LOADS) holds however many workers claim at once;
queued placements are claimed with SKIP LOCKED in priority order. Prewarms are paced so
that they take at most MINT_NODE_PREWARM_DUTY of a node's time (rollbacks are not):
loads and warm-ups run on the engine that serves everyone else's requests. HTTP to vLLM never
happens inside these transactions: tasks call vLLM, then record the outcome here.
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Case, Count, DateTimeField, F, Q, Value, When
from django.utils import timezone

from adapters.models import AdapterRevision
from mint_site.events import epoch_us, live_event
from serving import selectors, tasks
from serving.models import (
    ACTIVE_STATES,
    HOLDING_STATES,
    NodeState,
    Placement,
    PlacementState,
    Priority,
    ServingNode,
    lora_name,
)

log = logging.getLogger(__name__)
P = PlacementState


def _send(task, *, queue: str | None = None, countdown: float | None = None, **kwargs) -> None:
    """Enqueue a task of serving.tasks (a node's queue for node work), after the caller's commit."""
    task.apply_async(kwargs=kwargs, queue=queue, countdown=countdown)


# ---------------------------------------------------------------- placement and eviction


def eviction_victim(node: ServingNode, *, protected: set[int]) -> Placement | None:
    """The least recently used ready placement on `node` whose revision is not protected."""
    return (
        Placement.objects.filter(node=node, state=P.READY)
        .exclude(revision_id__in=protected)
        .select_related("revision__adapter")
        .order_by(F("last_used_at").asc(nulls_first=True), "ready_at", "id")
        .first()
    )


def _placement_event(
    placement_id: int,
    *,
    state: str,
    updated_at: datetime,
    revision: AdapterRevision,
    node: ServingNode,
    **fields: float | None,
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


def placement_request(*, revision: AdapterRevision, priority: int) -> Placement | None:
    """Ask for `revision` to be loaded on a node of its base model (queued for admission).

    Returns the placement (existing or new; an existing one keeps the higher priority), or
    None when no node of that base model is up or every node is full of protected adapters.
    Never waits for the load itself.
    """
    with transaction.atomic():
        existing = (
            Placement.objects.select_for_update()
            .filter(revision=revision, node__state=NodeState.UP)
            .exclude(state=P.EVICTING)
            .select_related("node")
            .first()
        )
        if existing is not None:
            existing.updated_at = timezone.now()
            if existing.state == P.FAILED:
                existing.state, existing.attempts, existing.failure_reason = P.QUEUED, 0, ""
                existing.queued_at = existing.updated_at
                _placement_event(
                    existing.id, state=P.QUEUED, updated_at=existing.updated_at, revision=revision, node=existing.node
                )
            existing.priority = max(existing.priority, priority)
            existing.save(update_fields=["state", "attempts", "failure_reason", "queued_at", "priority", "updated_at"])
            if existing.state == P.QUEUED:
                transaction.on_commit(lambda: admit(node_id=existing.node_id))
            return existing
        nodes = list(
            ServingNode.objects.filter(state=NodeState.UP, base_model_id=revision.adapter.base_model_id)
            .exclude(placements__revision=revision)  # e.g. still being evicted there
            .annotate(holding=Count("placements", filter=Q(placements__state__in=HOLDING_STATES)))
            .order_by("holding", "name")
        )
        nodes = [node for node in nodes if node_can_load(node, revision)]
        if not nodes:
            log.warning(
                "no up node serves %s for %s (or none has the flags and rank it needs)",
                revision.adapter.base_model,
                revision,
            )
            return None
        protected = selectors.protected_revision_ids()
        for node in nodes:
            locked = ServingNode.objects.select_for_update().get(id=node.id)
            holding = Placement.objects.filter(node=locked, state__in=HOLDING_STATES).count()
            victim = None
            if holding >= locked.cpu_slots:
                victim = eviction_victim(locked, protected=protected)
                if victim is None:
                    continue
                now = timezone.now()
                Placement.objects.filter(id=victim.id, state=P.READY).update(state=P.EVICTING, updated_at=now)
                # Gateways stop routing to it now, not when their cached route expires.
                _placement_event(victim.id, state=P.EVICTING, updated_at=now, revision=victim.revision, node=locked)
            placement = Placement.objects.create(node=locked, revision=revision, priority=priority)
            _placement_event(
                placement.id, state=placement.state, updated_at=placement.updated_at, revision=revision, node=locked
            )
            if victim is not None:
                transaction.on_commit(
                    lambda v=victim, q=locked.queue: _send(tasks.placement_unload, queue=q, placement_id=v.id)
                )
            transaction.on_commit(lambda n=locked.id: admit(node_id=n))
            return placement
    log.warning("every node for %s is full of protected adapters", revision)
    return None


def node_can_load(node: ServingNode, revision: AdapterRevision) -> bool:
    """Whether `node` runs with the engine flags and LoRA rank the revision's export needs (a packed MoE
    export needs `--enable-mixed-moe-lora-format` and a rank covering its stacked factors)."""
    record = revision.policy_record or {}
    missing = set(record.get("engine_flags") or ()) - set(node.engine_flags or ())
    return not missing and node.max_lora_rank >= int(record.get("min_max_lora_rank") or 0)


def admit(*, node_id: int) -> list[int]:
    """Start prewarming the highest-priority queued placements, up to the node's cold-load limit."""
    with transaction.atomic():
        node = ServingNode.objects.select_for_update().filter(id=node_id).first()
        if node is None or node.state != NodeState.UP:
            return []
        active = Placement.objects.filter(node=node, state__in=ACTIVE_STATES).count()
        free = settings.MINT_NODE_COLD_LOADS - active
        if free <= 0:
            return []
        queued = list(
            Placement.objects.select_for_update(skip_locked=True)
            .filter(node=node, state=P.QUEUED)
            .order_by("-priority", "queued_at", "id")
            .values_list("id", "priority")[:free]
        )
        if not queued:
            return []
        delay = prewarm_pacing_delay(node, priority=queued[0][1])
        if delay > 0:
            _admit_later(node.id, delay)
            return []
        claimed = [placement_id for placement_id, _ in queued]
        now = timezone.now()
        Placement.objects.filter(id__in=claimed).update(
            state=P.LOADING, started_at=now, updated_at=now, attempts=F("attempts") + 1
        )
        if claimed:
            for placement in Placement.objects.filter(id__in=claimed).select_related("revision__adapter"):
                _placement_event(placement.id, state=P.LOADING, updated_at=now, revision=placement.revision, node=node)
        for placement_id in claimed:
            transaction.on_commit(
                lambda p=placement_id, q=node.queue: _send(tasks.placement_prewarm, queue=q, placement_id=p)
            )
    return claimed


def prewarm_pacing_delay(node: ServingNode, *, priority: int) -> float:
    """Seconds before `node` may start its next prewarm of `priority` (0: now).

    A prewarm that kept the node busy for t seconds (fetch, verify and load, then the warm-up)
    is followed by a pause of t·(1-duty)/duty, at most MINT_NODE_PREWARM_MAX_GAP_S, so that
    a burst of activations takes at most MINT_NODE_PREWARM_DUTY of the engine's time and the
    requests it is serving meanwhile keep their latency. A rollback never waits.
    """
    duty = settings.MINT_NODE_PREWARM_DUTY
    if duty >= 1 or priority >= Priority.ROLLBACK:
        return 0.0
    last = (
        Placement.objects.filter(node=node, ready_at__isnull=False)
        .order_by("-ready_at")
        .values_list("ready_at", "load_ms", "warm_ms")
        .first()
    )
    if last is None:
        return 0.0
    ready_at, load_ms, warm_ms = last
    busy_s = ((load_ms or 0) + (warm_ms or 0)) / 1000
    gap = min(busy_s * (1 - duty) / duty, settings.MINT_NODE_PREWARM_MAX_GAP_S)
    return max(0.0, (ready_at - timezone.now()).total_seconds() + gap)


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
    return _move(placement, sources=(P.WARMING,), to=P.READY, warm_ms=warm_ms, ready_at=now, last_used_at=now)


def placement_failed(*, placement: Placement, reason: str) -> str:
    """A prewarm attempt failed: queue it again while attempts remain, else `failed` with the reason."""
    retry = placement.attempts < settings.MINT_PREWARM_ATTEMPTS
    to = P.QUEUED if retry else P.FAILED
    _move(placement, sources=(P.LOADING, P.WARMING), to=to, failure_reason=reason[:2000])
    log.warning("prewarm of %s failed (attempt %s): %s", placement, placement.attempts, reason)
    admit(node_id=placement.node_id)
    return to


def placement_forget(*, placement: Placement) -> None:
    """Drop the bookkeeping of an unloaded placement, freeing its slot."""
    Placement.objects.filter(id=placement.id).delete()
    admit(node_id=placement.node_id)


def ready_count(revision: AdapterRevision) -> int:
    return Placement.objects.filter(revision=revision, state=P.READY, node__state=NodeState.UP).count()


# ---------------------------------------------------------------- reconcile


def node_reconcile(*, node: ServingNode, loaded: set[str]) -> dict[str, int]:
    """Make the records of an up node match what its vLLM really holds.

    A placement marked ready or warming whose LoRA name vLLM no longer lists was lost
    (the engine restarted): live and desired revisions are queued again to be
    re-prewarmed, others are forgotten. A load stuck past MINT_PREWARM_TIMEOUT_S (its
    agent died) is queued again.
    """
    protected = selectors.protected_revision_ids()
    requeued = forgotten = 0
    now = timezone.now()
    placements = Placement.objects.filter(node=node).select_related("revision__adapter")
    with transaction.atomic():
        for placement in placements.filter(state__in=(P.READY, P.WARMING)).select_for_update(of=("self",)):
            if lora_name(placement.revision) in loaded:
                continue
            if placement.revision_id in protected:
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
        stuck = now - timedelta(seconds=settings.MINT_PREWARM_TIMEOUT_S)
        timed_out = list(placements.filter(state=P.LOADING, started_at__lt=stuck).select_for_update(of=("self",)))
        requeued += Placement.objects.filter(id__in=[p.id for p in timed_out]).update(
            state=P.QUEUED, updated_at=now, failure_reason="prewarm timed out"
        )
        for placement in timed_out:
            _placement_event(placement.id, state=P.QUEUED, updated_at=now, revision=placement.revision, node=node)
    admit(node_id=node.id)
    return {"requeued": requeued, "forgotten": forgotten}


# ---------------------------------------------------------------- use (from the gateway)

_TOUCH_CHUNK = 500


def placements_touch(*, used: dict[int, datetime]) -> int:
    """Record when placements last answered a request (eviction is LRU on it): one UPDATE per chunk of ids,
    `SET last_used_at = CASE id WHEN … END`. The gateway batches uses and calls this from a database thread."""
    ids = sorted(used)
    written = 0
    for start in range(0, len(ids), _TOUCH_CHUNK):
        chunk = ids[start : start + _TOUCH_CHUNK]
        value = Case(*(When(id=i, then=Value(used[i])) for i in chunk), output_field=DateTimeField())
        written += Placement.objects.filter(id__in=chunk).update(last_used_at=value)
    return written
