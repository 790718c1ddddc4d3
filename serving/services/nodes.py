"""Writes about serving nodes: registering one, recording its state (heartbeats, staff draining it), draining
it without a gap, and making its records match what its engine really holds (reconcile)."""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from mint_site.errors import Conflict, MintError
from mint_site.events import live_event
from serving import selectors
from serving.models import NodeState, Placement, PlacementState, Priority, ServingNode, lora_name
from serving.selectors.pins import pinned_revisions, protected_revision_ids
from serving.services import outbox, sweep
from serving.services.admission import admit
from serving.services.failover import placements_retry
from serving.services.placement import evict
from tenants.access import Actor
from tenants.services import audit_record


@transaction.atomic
def node_register(
    *,
    name: str,
    base_model,
    url: str,
    served_model_name: str,
    gpu_slots: int,
    cpu_slots: int,
    max_lora_rank: int,
    cache_dir: str,
    engine_flags: list[str] | None = None,
    by: Actor,
) -> ServingNode:
    """Add a serving node, or update the one with this name. It starts `down` until a heartbeat sees it."""
    if gpu_slots < 1 or cpu_slots < gpu_slots:
        raise MintError("cpu_slots must be at least gpu_slots, and gpu_slots at least 1.", code="invalid_slots")
    node, created = ServingNode.objects.update_or_create(
        name=name,
        defaults={
            "base_model": base_model,
            "url": url.rstrip("/"),
            "served_model_name": served_model_name,
            "gpu_slots": gpu_slots,
            "cpu_slots": cpu_slots,
            "max_lora_rank": max_lora_rank,
            "cache_dir": cache_dir,
            "engine_flags": engine_flags or [],
        },
    )
    audit_record(
        tenant=None,
        actor=by,
        action="node.create" if created else "node.update",
        target=f"node:{name}",
        after={
            "url": node.url,
            "base_model": base_model.name,
            "gpu_slots": gpu_slots,
            "cpu_slots": cpu_slots,
            "engine_flags": node.engine_flags,
        },
    )
    return node


@transaction.atomic
def node_set_state(
    *,
    node: ServingNode,
    state: str,
    by: Actor,
    engine_version: str = "",
    heartbeat: bool = False,
    max_model_len: int | None = None,
    only_from: tuple[str, ...] = (),
) -> bool:
    """Record a node's state (from a heartbeat, or staff draining it), and what its engine reports (version,
    context window). With `only_from`, the state changes only from one of those.

    The row is read under a lock, so a heartbeat that read the node before staff drained it cannot write its
    old state back. Staff's drain holds until they undrain: draining sets `drain_requested`, and a node with it
    set that is seen up again after being down comes back draining (its ready placements are then the engine's,
    reconciled by the heartbeat). `node.state` is the state as recorded after. Returns whether it changed.
    """
    now = timezone.now()
    fields: dict = {"last_heartbeat_at": now} if heartbeat else {}
    if engine_version:
        fields["engine_version"] = engine_version
    if max_model_len:
        fields["max_model_len"] = max_model_len
    before, drain_requested = (
        ServingNode.objects.select_for_update().values_list("state", "drain_requested").get(id=node.id)
    )
    if state == NodeState.UP and before == NodeState.DOWN and drain_requested:
        state = NodeState.DRAINING
    changed = before != state and (not only_from or before in only_from)
    if changed:
        fields |= {"state": state, "state_changed_at": now}
        if state == NodeState.DRAINING or before == NodeState.DRAINING:
            fields["drain_requested"] = state != NodeState.UP  # draining, or down while draining
    if fields:
        ServingNode.objects.filter(id=node.id).update(**fields)
    node.state = state if changed else before
    node.drain_requested = fields.get("drain_requested", drain_requested)
    if changed:
        audit_record(
            tenant=None,
            actor=by,
            action="node.state",
            target=f"node:{node.name}",
            before={"state": before},
            after={"state": state},
        )
        live_event(tenant_id=None, type="node.state", id=node.id, state=state, node=node.name)
    return changed


def node_undrain(*, node: ServingNode, by: Actor) -> bool:
    """Take a draining node back into service (staff: `mint_node undrain`, the API, the Nodes page). Returns whether
    it was draining (False: up already). A down node is never marked up by staff's word: one that was draining
    when it went down comes back up rather than draining (True); any other is a 409."""
    if node_set_state(node=node, state=NodeState.UP, by=by, only_from=(NodeState.DRAINING,)):
        return True
    if node.state != NodeState.DOWN:
        return False
    with transaction.atomic():
        down_draining = ServingNode.objects.filter(id=node.id, state=NodeState.DOWN, drain_requested=True)
        if not down_draining.update(drain_requested=False):
            raise Conflict(f"Node {node.name} is down; it comes back up with its next heartbeat.", code="node_down")
        node.drain_requested = False
        audit_record(
            tenant=None,
            actor=by,
            action="node.undrain",
            target=f"node:{node.name}",
            before={"state": node.state, "drain_requested": True},
            after={"state": node.state, "drain_requested": False},
        )
    return True


def _probe_key(node_id: int) -> str:
    return f"serving:node-probe:{node_id}"


def node_report_unreachable(*, name: str) -> bool:
    """A gateway could not reach the node: probe it now rather than at the next heartbeat. Returns whether asked.

    Every gateway process reports its own failures; one probe per node is sent per
    MINT_GATEWAY_NODE_SUSPECT_S whichever process reports (a mark in the shared cache), so a flood of
    failures costs one task. A node already down (or unknown) is not probed: the heartbeat watches for its
    return.
    """
    node_id = (
        ServingNode.objects.filter(name=name, state__in=(NodeState.UP, NodeState.DRAINING))
        .values_list("id", flat=True)
        .first()
    )
    if node_id is None:
        return False
    if not cache.add(_probe_key(node_id), 1, timeout=max(1, math.ceil(settings.MINT_GATEWAY_NODE_SUSPECT_S))):
        return False
    outbox.send("node_probe", node_id=node_id)
    return True


P = PlacementState


def node_drain(*, node: ServingNode, by: Actor, force: bool = False) -> dict[str, object]:
    """Start draining `node` (staff: `mint_node drain`, the API, the Nodes page) and take the first step."""
    node_set_state(node=node, state=NodeState.DRAINING, by=by, only_from=(NodeState.UP,))
    if node.state == NodeState.DOWN:
        raise Conflict(f"Node {node.name} is down: there is nothing on it to move.", code="node_down")
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
    pins = pinned_revisions(base_model_id=node.base_model_id)
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
            room = sum(selectors.node_can_load(other, placement.revision) for other in others)
            needed = max(1, min(placement.revision.adapter.replica_count, room))
            if force or placement.revision_id not in pins or elsewhere[placement.revision_id] >= needed:
                evict(placement, reason=None)
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
    """Make the records of an up or draining node match what its vLLM really holds (`loaded`, as read at
    `seen_at`).

    A placement marked ready or warming whose LoRA name vLLM no longer lists was lost
    (the engine restarted): on an up node, live and desired revisions are queued again to be
    re-prewarmed, unless they hold their replica count on other up nodes already (placed
    there while this node was down); others are forgotten, and every one on a draining node (the heartbeat's
    `placements_retry` places what is pinned elsewhere). A load stuck past MINT_PREWARM_TIMEOUT_S from when
    its agent began it (its agent died), or from its claim if no agent began it (its task
    was lost with the broker and no probe came back: serving/services/sweep.py), is queued
    again while it has attempts left (MINT_PREWARM_ATTEMPTS), else it fails: a load that
    kills its agent cannot come back forever. An eviction whose unload task was lost is
    finished: forgotten when vLLM no longer lists the LoRA, else its unload is sent again
    once it is overdue, counted the same way (`sweep.handoffs_overdue`).
    """
    protected = protected_revision_ids()
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
                node.state == NodeState.UP
                and placement.revision_id in protected
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
                outbox.placement_event(
                    placement.id, state=P.QUEUED, updated_at=now, revision=placement.revision, node=node
                )
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
