"""Reads of the serving plane, for its own services, the REST API, the gateway and the dashboard.

Aliases are serving state (what each name of an adapter serves now and should serve next), so
everything that shows or routes by an alias reads it here. Metered usage, summed per group for the
usage API and the dashboard, is read in `serving.selectors.usage`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from django.conf import settings
from django.db.models import Exists, OuterRef, Prefetch, QuerySet
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import (
    ACTIVE_STATES,
    HOLDING_STATES,
    Alias,
    NodeState,
    Placement,
    PlacementState,
    PrewarmTurn,
    ServingNode,
)
from serving.selectors.pins import pinned_revisions


def with_aliases(adapters: QuerySet[Adapter], *, previous: bool = False, placements: bool = False) -> QuerySet[Adapter]:
    """`adapters` with their aliases (and the revisions they name) prefetched as `adapter.aliases.all()`, and
    with `placements`, where each desired revision is being placed."""
    related = ["revision", "desired_revision", "canary_revision"] + (["previous_revision"] if previous else [])
    aliases = Alias.objects.select_related(*related).order_by("name")
    if placements:
        aliases = aliases.prefetch_related("desired_revision__placements__node")
    return adapters.prefetch_related(Prefetch("aliases", queryset=aliases))


def live_revision(*, adapter: Adapter, alias_name: str) -> AdapterRevision | None:
    """The revision an alias of `adapter` serves now, or None (no such alias, or it never flipped)."""
    alias = Alias.objects.filter(adapter=adapter, name=alias_name).select_related("revision").first()
    return alias.revision if alias is not None else None


def routing_alias(*, adapter: Adapter, alias_name: str) -> Alias | None:
    """An alias with the revisions the gateway routes it to: the live one and its canary's candidate (one query)."""
    return Alias.objects.filter(adapter=adapter, name=alias_name).select_related("revision", "canary_revision").first()


def live_aliases(*, tenant_id: int) -> QuerySet[Alias]:
    """The tenant's aliases that serve a revision now, with their adapter (name, creation); in no given order."""
    return (
        Alias.objects.filter(adapter__tenant_id=tenant_id, revision__isnull=False)
        .select_related("adapter")
        .only("name", "adapter__name", "adapter__created_at")
    )


def node_can_load(node: ServingNode, revision: AdapterRevision) -> bool:
    """Whether `node` runs with the engine flags and LoRA rank the revision's export needs (a packed MoE
    export needs `--enable-mixed-moe-lora-format` and a rank covering its stacked factors)."""
    record = revision.policy_record or {}
    missing = set(record.get("engine_flags") or ()) - set(node.engine_flags or ())
    return not missing and node.max_lora_rank >= int(record.get("min_max_lora_rank") or 0)


def ready_count(revision: AdapterRevision) -> int:
    """On how many up nodes `revision` is ready (what a flip and a canary wait for)."""
    return Placement.objects.filter(revision=revision, state=PlacementState.READY, node__state=NodeState.UP).count()


def node_by_name(name: str) -> ServingNode | None:
    return ServingNode.objects.select_related("base_model").filter(name=name).first()


def ready_placements(*, revision: AdapterRevision) -> QuerySet[Placement]:
    """Where `revision` can be routed now: its ready placements on up nodes, and on draining ones (they serve
    until the revision is ready elsewhere: serving.services.nodes.drain_step), with the node, oldest first."""
    return (
        Placement.objects.filter(
            revision=revision, state=PlacementState.READY, node__state__in=(NodeState.UP, NodeState.DRAINING)
        )
        .select_related("node")
        .order_by("id")
    )


def stranded_canaries(*, base_model_id: int | None = None) -> QuerySet[Alias]:
    """Aliases whose canary routes (its candidate was ready once) while nobody can reach the candidate now: it has
    no ready placement on a node that serves (up, or draining), because its node went down or its engine lost
    it. `serving.services.canary.canaries_stranded_abort` ends them."""
    routable = Placement.objects.filter(
        revision_id=OuterRef("canary_revision_id"),
        state=PlacementState.READY,
        node__state__in=(NodeState.UP, NodeState.DRAINING),
    )
    aliases = Alias.objects.filter(canary_ready_at__isnull=False).exclude(Exists(routable))
    if base_model_id is not None:
        aliases = aliases.filter(adapter__base_model_id=base_model_id)
    return aliases.order_by("id")


def alias_for_converge(alias_id: int) -> Alias | None:
    """An alias with what converging it reads (its adapter's base model and tenant, for the replica count; its
    desired revision)."""
    return (
        Alias.objects.select_related(
            "adapter__base_model",
            "adapter__tenant",
            "revision",
            "desired_revision__adapter",
            "previous_revision",
            "canary_revision__adapter",
        )
        .filter(id=alias_id)
        .first()
    )


# ---------------------------------------------------------------- why an activation waits (REST API, dashboard)

P = PlacementState
_PROGRESS = (P.WARMING, P.LOADING, P.QUEUED)  # most advanced first
_NEVER = datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True)
class ActivationStatus:
    """Where an alias's pending activation stands: its phase, and a sentence a person can act on.

    `phase`: `requested` (no placement yet), `no_node` (no up node of the base model can load it), `waiting`
    (no slot free, none may be taken for it now), `queued` (a slot is its own; waiting for admission),
    `loading`, `warming`, `failed` (every prewarm attempt failed). `position` is the 1-based place in the
    node's admission queue while queued (an estimate: the order `placement.admit` takes, tenants in turns,
    without pacing pauses); `since` when the phase began; `quota` the tenant's pinned revisions of the base
    model and its plan's limit (`max_ready_revisions`).
    """

    alias: str
    revision_label: str
    phase: str
    reason: str
    position: int | None = None
    since: datetime | None = None
    node: str | None = None
    quota: dict[str, int] | None = None
    can_cancel: bool = True
    rollback: bool = False

    def as_json(self) -> dict:
        data = asdict(self)
        data["since"] = self.since.isoformat() if self.since is not None else None
        return data


def activation_status(alias: Alias, *, now: datetime | None = None) -> ActivationStatus | None:
    """Why `alias` does not serve its desired revision yet; None when nothing is pending (desired == live).

    A constant number of queries (at most 7, fewer with `with_aliases(..., placements=True)` and the
    adapter's tenant loaded), however many placements, nodes or queued prewarms there are.
    """
    if alias.desired_revision_id is None or alias.desired_revision_id == alias.revision_id:
        return None
    now = now or timezone.now()
    desired = alias.desired_revision
    if Alias.adapter.is_cached(alias):
        adapter = alias.adapter
    else:
        adapter = Adapter.objects.select_related("tenant", "base_model").get(id=alias.adapter_id)
    tenant = adapter.tenant
    placements = _placements_of(desired)
    nodes = list(ServingNode.objects.filter(base_model_id=adapter.base_model_id).order_by("name"))
    up = [n for n in nodes if n.state == NodeState.UP and node_can_load(n, desired)]
    quota = _pin_quota(tenant, adapter.base_model_id)
    status = partial(
        ActivationStatus,
        quota=quota,
        alias=alias.name,
        revision_label=desired.label,
        rollback=alias.rollback_pending,
    )
    up_ids = {n.id for n in up}
    on_up = [p for p in placements if p.node_id in up_ids]
    ready = [p for p in on_up if p.state == P.READY]
    needed = adapter.replica_count
    if len(ready) >= needed:
        first = ready[0]
        return status(
            phase="warming",
            reason=f"Ready on {first.node.name}; the alias flips now.",
            since=first.ready_at,
            node=first.node.name,
        )
    note = f" (ready on {len(ready)} of the {needed} nodes a flip needs)" if ready else ""
    moving = sorted((p for p in on_up if p.state in _PROGRESS), key=lambda p: (_PROGRESS.index(p.state), p.id))
    if moving:
        current = moving[0]
        node = current.node.name
        if current.state == P.WARMING:
            since = current.loaded_at or current.updated_at
            reason = f"Warming up on {node} for {_elapsed(now - since)}{note}"
            return status(phase="warming", reason=reason, since=since, node=node)
        if current.state == P.LOADING:
            since = current.started_at or current.updated_at
            reason = f"Loading on {node} for {_elapsed(now - since)}{note}"
            return status(phase="loading", reason=reason, since=since, node=node)
        position, reason = _queue_place(current, tenant_id=adapter.tenant_id, now=now)
        return status(phase="queued", reason=reason + note, position=position, since=current.queued_at, node=node)
    if not up:
        since, reason = _no_node(nodes, desired, adapter.base_model.name, alias)
        return status(phase="no_node", reason=reason, since=since)
    if ready and len(up) < needed:
        reason = (
            f"Ready on {len(ready)} of the {needed} nodes a flip needs (the adapter's replicas), but only "
            f"{len(up)} node of {adapter.base_model.name} that can load it is up: it flips when another comes "
            "up; or cancel."
        )
        return status(phase="waiting", reason=reason, since=ready[0].ready_at, node=ready[0].node.name)
    waiting = next((p for p in placements if p.state == P.WAITING), None)
    if waiting is not None:
        reason = _no_slot(waiting, up, tenant=tenant, base_model=adapter.base_model.name, quota=quota)
        return status(phase="waiting", reason=reason, since=waiting.queued_at, node=waiting.node.name)
    failed = next((p for p in placements if p.state == P.FAILED), None)
    if failed is not None:
        reason = (
            f"Prewarm failed: {failed.failure_reason or 'no reason recorded'} (on {failed.node.name}, "
            f"{failed.attempts} attempts). Activate r{desired.number} again to retry, or cancel."
        )
        return status(phase="failed", reason=reason, since=failed.updated_at, node=failed.node.name)
    reason = (
        f"Requested {_elapsed(now - alias.updated_at)} ago; no node has been chosen for {desired.label} yet "
        f"(the serving plane places it within {settings.MINT_HEARTBEAT_S} s)."
    )
    return status(phase="requested", reason=reason, since=alias.updated_at)


def activation_room(adapter: Adapter, revision: AdapterRevision, *, reserve: bool | None = None) -> str | None:
    """A warning when activating `revision` on `adapter`'s production alias now would not flip soon, or None.

    Warns when the tenant's pinned-revision quota is full (activation is refused then: 429), when no up node
    of the base model can load it (or fewer than the adapter's replica count), or when no slot is free and the
    tenant is at or over its fair share of the base model's slots (the activation would wait for one). None
    when it is live, on its way, or would find room.
    At most 6 queries.
    """
    tenant = adapter.tenant
    base = adapter.base_model
    rows = list(
        Alias.objects.filter(adapter__tenant_id=tenant.id, adapter__base_model_id=base.id).values_list(
            "adapter_id", "name", "desired_revision_id", "revision_id", "reserved"
        )
    )
    own = next((r for r in rows if r[0] == adapter.id and r[1] == Alias.PRODUCTION), None)
    if own is not None and own[2] == revision.id:
        return None  # live already, or already asked for
    # The count capacity.check_pin refuses past (when the alias is reserved): what the reserved aliases serve once
    # converged, this alias moved.
    reserved = [r for r in rows if r[4]]
    before = {desired or live for _, _, desired, live, _ in reserved if desired or live}
    after = {desired or live for a, n, desired, live, _ in reserved if (a, n) != (adapter.id, Alias.PRODUCTION)}
    after = {r for r in after if r} | {revision.id}
    reserving = reserve if reserve is not None else (own is not None and own[4])
    if reserving and len(after) > tenant.max_ready_revisions and len(after) > len(before):
        return (
            f"Activating {revision.label} would be refused: tenant {tenant.slug} pins {len(before)} of its "
            f"{tenant.max_ready_revisions} revisions of {base.name} (plan field max_ready_revisions). Move an alias "
            "to a revision already pinned, or roll one back, first."
        )
    placed = list(Placement.objects.filter(revision=revision).exclude(state__in=(P.FAILED, P.WAITING, P.EVICTING)))
    up = [
        n
        for n in ServingNode.objects.filter(base_model_id=base.id, state=NodeState.UP).order_by("name")
        if node_can_load(n, revision)
    ]
    if not up:
        return f"No node of {base.name} that can load {revision.label} is up: it would wait until one is."
    if len(up) < adapter.replica_count:
        return (
            f"{adapter.name} has {adapter.replica_count} replicas and only {len(up)} node of {base.name} that can "
            f"load {revision.label} is up: it would not flip until another is (or lower the adapter's replicas)."
        )
    if any(p.node_id in {n.id for n in up} for p in placed):
        return None  # loaded or on its way
    holding = list(
        Placement.objects.filter(node__in=up, state__in=HOLDING_STATES).values_list(
            "node_id", "state", "revision_id", "revision__adapter__tenant_id"
        )
    )
    per_node = Counter(node_id for node_id, *_ in holding)
    if any(per_node[n.id] < n.cpu_slots for n in up):
        return None
    pins = pinned_revisions(base_model_id=base.id)
    if any(state == P.READY and rev not in pins for _, state, rev, _ in holding):
        return None  # a revision nobody pins gives its slot up
    slots = sum(n.cpu_slots for n in up)
    held = Counter(t for *_, t in holding)
    fair = slots / max(1, len(set(pins.values()) | {tenant.id}))
    if held[tenant.id] + 1 <= fair and any(n > fair for t, n in held.items() if t != tenant.id):
        return None  # it may take a slot from a tenant over its fair share
    return (
        f"Every slot of {base.name} is taken ({len(holding)} of {slots}) and tenant {tenant.slug} holds "
        f"{held[tenant.id]}, its fair share being {fair:.1f}: {revision.label} would wait for a slot until a "
        "revision is unpinned (roll back or cancel another activation)."
    )


def _placements_of(revision: AdapterRevision) -> list[Placement]:
    """The revision's placements (not being evicted) with their nodes, from `with_aliases`'s prefetch if made."""
    if "placements" in getattr(revision, "_prefetched_objects_cache", {}):
        rows = [p for p in revision.placements.all() if p.state != P.EVICTING]
        return sorted(rows, key=lambda p: p.id)
    return list(
        Placement.objects.filter(revision=revision).exclude(state=P.EVICTING).select_related("node").order_by("id")
    )


def _pin_quota(tenant, base_model_id: int) -> dict[str, int]:
    """The tenant's reserved revisions of a base model as capacity.check_pin counts them, and its plan's limit."""
    rows = Alias.objects.filter(
        adapter__tenant_id=tenant.id, adapter__base_model_id=base_model_id, reserved=True
    ).values_list("desired_revision_id", "revision_id")
    return {"used": len({d or live for d, live in rows if d or live}), "limit": tenant.max_ready_revisions}


def _queue_place(placement: Placement, *, tenant_id: int, now: datetime) -> tuple[int, str]:
    """A queued placement's 1-based place in its node's admission queue, and a sentence saying what is ahead."""
    rows = list(
        Placement.objects.filter(node_id=placement.node_id, state__in=(P.QUEUED, *ACTIVE_STATES)).values_list(
            "id", "state", "priority", "queued_at", "revision__adapter__tenant_id"
        )
    )
    turns = {
        t: (started, resting)
        for t, started, resting in PrewarmTurn.objects.filter(node_id=placement.node_id).values_list(
            "tenant_id", "started_at", "resting_until"
        )
    }
    order = _admission_order([r for r in rows if r[1] == P.QUEUED], {t: s for t, (s, _) in turns.items()})
    place = order.index(placement.id) if placement.id in order else len(order)
    ahead = set(order[:place]) | {r[0] for r in rows if r[1] != P.QUEUED}
    others = sum(1 for r in rows if r[0] in ahead and r[4] != tenant_id)
    node = placement.node.name
    if ahead:
        plural = "s" if len(ahead) != 1 else ""
        reason = f"Queued on node {node} behind {len(ahead)} prewarm{plural} ({others} of other tenants)"
    else:
        reason = f"Queued on node {node}, next to load"
    resting = turns.get(tenant_id, (None, None))[1]
    if resting is not None and resting > now:
        reason += (
            f"; your tenant's prewarms on {node} are paced (MINT_NODE_PREWARM_DUTY), the next may start in "
            f"{_elapsed(resting - now)}"
        )
    if placement.attempts and placement.failure_reason:
        reason += f"; attempt {placement.attempts} failed: {placement.failure_reason}"
    return place + 1, reason


def _admission_order(queued: list[tuple], turns: dict[int, datetime]) -> list[int]:
    """The ids of queued placements (id, state, priority, queued_at, tenant) in the order admission takes them:
    higher priority first; inside a class tenants take turns, the one whose last prewarm on the node started
    longest ago first, each tenant's oldest first."""
    order: list[int] = []
    for priority in sorted({r[2] for r in queued}, reverse=True):
        lines: dict[int, list[tuple]] = {}
        for row in sorted((r for r in queued if r[2] == priority), key=lambda r: (r[3], r[0])):
            lines.setdefault(row[4], []).append(row)
        ring = sorted(lines, key=lambda t: (turns.get(t, _NEVER), lines[t][0][3], lines[t][0][0]))
        depth = 0
        while ring:
            order += [lines[t][depth][0] for t in ring]
            depth += 1
            ring = [t for t in ring if len(lines[t]) > depth]
    return order


def _no_node(nodes: list[ServingNode], revision: AdapterRevision, base_model: str, alias: Alias):
    """(since, reason) when no up node of the base model can load the revision."""
    if not nodes:
        return alias.updated_at, (
            f"No serving node runs {base_model}; {revision.label} flips once one is registered and up."
        )
    up = [n for n in nodes if n.state == NodeState.UP]
    if not up:
        states = ", ".join(f"{n.name} is {n.state}" for n in nodes[:5]) + (", …" if len(nodes) > 5 else "")
        since = max([alias.updated_at, *(n.state_changed_at for n in nodes)])
        return since, f"No node of {base_model} is up ({states}); {revision.label} flips once one is."
    record = revision.policy_record or {}
    flags = ", ".join(record.get("engine_flags") or ()) or "none"
    rank = record.get("min_max_lora_rank") or "any"
    return alias.updated_at, (
        f"No up node of {base_model} can load {revision.label}: it needs engine flags {flags} and a max LoRA "
        f"rank of {rank}; ask an operator for such a node."
    )


def _no_slot(placement: Placement, up: list[ServingNode], *, tenant, base_model: str, quota: dict[str, int]) -> str:
    """Why a waiting placement finds no slot: the base model's slots, who holds them, the tenant's share and quota."""
    pins = pinned_revisions(base_model_id=placement.node.base_model_id)
    holding = list(
        Placement.objects.filter(node__in=up, state__in=HOLDING_STATES).values_list(
            "revision_id", "revision__adapter__tenant_id"
        )
    )
    slots = sum(n.cpu_slots for n in up)
    held = Counter(t for _, t in holding)
    pinned = sum(1 for revision_id, _ in holding if revision_id in pins)
    fair = slots / max(1, len(set(pins.values()) | {tenant.id}))
    if len(holding) < slots:
        return (
            f"Waiting for capacity ({placement.failure_reason}); a slot of {base_model} is free now, and it is "
            f"placed on the next retry (within {settings.MINT_HEARTBEAT_S} s)."
        )
    if pinned >= len(holding):
        head = f"Every slot of {base_model} is pinned ({len(holding)} of {slots})"
    else:
        head = f"Every slot of {base_model} is taken ({len(holding)} of {slots}, {pinned} by pinned revisions)"
    return (
        f"{head}; your tenant holds {held[tenant.id]} (its fair share is {fair:.1f}) and pins {quota['used']} of "
        f"its {quota['limit']} revisions (max_ready_revisions). Cancel this activation, or roll back or move "
        "another alias to free a slot."
    )


def _elapsed(delta: timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
