"""Writes about aliases, the names that serve a revision: activation, rollback, cancel, and converging on them.

Activation and rollback set an alias's *desired* revision and ask the serving plane to converge
(the `alias_converge` task): the alias flips at once if that revision is ready on its adapter's replica
count of up nodes (`Adapter.replica_count`: the adapter's `replicas`, else MINT_ALIAS_READY_REPLICAS, at
most the plan's `max_replicas`), else placements are requested and the flip happens when enough prewarms
finish (`placement_ready`). Only approved revisions can be desired; every change is audited, and a flip is
a live event the gateway and the dashboard follow. `adapter_scale` changes the replica count and converges.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, RevisionState
from adapters.models.catalog import revision_label
from adapters.services.registration import adapter_set_replicas
from adapters.services.transitions import revision_ensure_export
from mint_site.errors import Conflict, InvalidTransition
from mint_site.events import live_event
from serving import selectors
from serving.models import Alias, NodeState, Placement, Priority
from serving.services import capacity, outbox, rollout
from serving.services.admission import admit, placement_warmed
from serving.services.placement import placement_request, placements_withdraw
from tenants.access import Actor
from tenants.services import audit_record

# ---------------------------------------------------------------- activation, flip, rollback


def _check_capacity(adapter: Adapter, alias: str, revision: AdapterRevision, *, reserve: bool | None) -> bool:
    """Refuse (429 serving_quota_exceeded) a new alias past the adapter's limit, a new live alias past the tenant's
    `max_live_aliases`, or, for a reserved alias, a new pin past its `max_ready_revisions`. Returns whether the
    alias is reserved after this activation (`reserve` None keeps what it was; a new alias is not reserved).
    Under the tenant's row lock: two activations at once cannot both take the last place."""
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    existing = Alias.objects.filter(adapter=adapter, name=alias).first()
    if existing is None:
        capacity.check_new_alias(adapter=adapter)
    if existing is None or (existing.revision_id is None and existing.desired_revision_id is None):
        capacity.check_live_alias(adapter=adapter)
    reserved = bool(existing.reserved if existing is not None and reserve is None else reserve)
    if reserved and existing is not None and not existing.reserved:
        capacity.check_reservation(adapter=adapter, alias=existing)
    if reserved and (existing is None or existing.desired_revision_id != revision.id or not existing.reserved):
        capacity.check_pin(
            adapter=adapter, alias=existing if existing and existing.reserved else None, revision=revision
        )
    return reserved


def _set_desired(target: Alias, revision: AdapterRevision, *, rollback: bool, by: Actor) -> None:
    """Point a locked alias's desired revision at `revision`, and audit it as an activation or a rollback (with
    an `alias.desired` live event, so open dashboards show what is pending).

    Asking for what the alias already wants changes nothing (and records nothing). Wanting a revision other
    than the live one ends the previous revision's pin: an alias holds at most one revision besides its target.
    """
    if target.desired_revision_id == revision.id and target.rollback_pending == rollback:
        return
    before = {"revision": revision_label(target.revision), "desired": revision_label(target.desired_revision)}
    target.desired_revision = revision
    target.rollback_pending = rollback
    target.updated_by = by.label
    target.updated_at = timezone.now()
    fields = ["desired_revision", "rollback_pending", "updated_by", "updated_at"]
    if revision.id != target.revision_id and target.previous_pinned_until is not None:
        target.previous_pinned_until = None
        fields.append("previous_pinned_until")
    target.save(update_fields=fields)
    audit_record(
        tenant=target.adapter.tenant,
        actor=by,
        action="alias.rollback" if rollback else "alias.activate",
        target=f"alias:{target.adapter.name}:{target.name}",
        before=before,
        after={"revision": revision_label(target.revision), "desired": revision_label(revision)},
    )
    live_event(
        tenant_id=target.adapter.tenant_id,
        type="alias.desired",
        id=target.id,
        state="pending" if revision.id != target.revision_id else "live",
        adapter=target.adapter.name,
        alias=target.name,
        revision=revision_label(target.revision),
        desired=revision_label(revision),
        rollback=rollback,
    )


@transaction.atomic
def revision_activate(
    *,
    adapter: Adapter,
    revision: AdapterRevision,
    by: Actor,
    alias: str = Alias.PRODUCTION,
    canary_percent: int | None = None,
    reserve: bool | None = None,
) -> Alias:
    """Make `revision` the desired target of `alias`. The alias flips when the serving plane has it ready.

    `reserve` True keeps what the alias serves loaded (a pin, within `max_ready_revisions`), False serves it on
    demand (prewarmed now so the alias flips to a ready revision, evicted when cold later); None keeps the
    alias's choice (a new alias is on demand). With `canary_percent` the alias does not flip: `revision` becomes
    its canary (`rollout.canary_start`). While a canary runs, a plain activation is refused (409 `canary_active`:
    promote or abort it first)."""
    if canary_percent is not None:
        return rollout.canary_start(adapter=adapter, revision=revision, percent=canary_percent, by=by, alias=alias)
    if revision.state != RevisionState.APPROVED:
        raise InvalidTransition(
            f"r{revision.number} is {revision.state}; only approved revisions can be activated.",
            detail={"state": revision.state},
        )
    reserved = _check_capacity(adapter, alias, revision, reserve=reserve)
    target = rollout.lock_alias(adapter, alias, create=True)
    if target.canary_revision_id is not None:
        raise Conflict(
            f"{adapter.name}:{alias} runs a canary of {target.canary_revision.label}; promote or abort it first.",
            code="canary_active",
        )
    if target.reserved != reserved:
        _set_reserved(target, reserved, by=by)
    _set_desired(target, revision, rollback=False, by=by)
    transaction.on_commit(lambda: outbox.send("alias_converge", alias_id=target.id))
    return target


@transaction.atomic
def revision_rollback(
    *, adapter: Adapter, by: Actor, alias: str = Alias.PRODUCTION, revision: AdapterRevision | None = None
) -> Alias:
    """Point `alias` back at the revision live before the current one (or at `revision`), as a rollback.

    Nothing is retrained: the target's frozen export is served again, re-exported from its
    source first if the export was removed.
    """
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)  # tenant before alias, as activation locks them
    target = Alias.objects.select_for_update().filter(adapter=adapter, name=alias).first()
    if target is None or target.revision is None:
        raise InvalidTransition(
            f"{adapter.name}:{alias} has never been live; there is nothing to roll back.", code="nothing_to_roll_back"
        )
    goal = revision or target.previous_revision
    if goal is None:
        raise InvalidTransition(
            f"{adapter.name}:{alias} has no earlier live revision; name one to roll back to.",
            code="nothing_to_roll_back",
        )
    if goal.state != RevisionState.APPROVED:
        raise InvalidTransition(
            f"r{goal.number} is {goal.state}; rollback needs an approved revision.", detail={"state": goal.state}
        )
    _check_capacity(adapter, alias, goal, reserve=None)
    if target.canary_revision_id is not None:  # a rollback is the way out of anything: it ends the canary too
        target.adapter = adapter
        rollout.abort_locked(target, by=by, reason=f"rollback to r{goal.number}")
    _set_desired(target, goal, rollback=True, by=by)
    revision_ensure_export(revision=goal)
    transaction.on_commit(lambda: outbox.send("alias_converge", alias_id=target.id))
    return target


def _set_reserved(target: Alias, reserved: bool, *, by: Actor) -> None:
    """Record a locked alias's reservation, audited (`alias.reserve`)."""
    target.reserved = reserved
    target.save(update_fields=["reserved"])
    audit_record(
        tenant=target.adapter.tenant,
        actor=by,
        action="alias.reserve",
        target=f"alias:{target.adapter.name}:{target.name}",
        before={"reserved": not reserved},
        after={"reserved": reserved},
    )


@transaction.atomic
def alias_reserve(*, adapter: Adapter, alias: str, reserved: bool, by: Actor) -> Alias:
    """Reserve an alias (what it serves stays loaded, within `max_ready_revisions`: 429 past it) or serve it on
    demand again. Reserving converges at once: what it serves is loaded on its replica count if it is not.
    Locks the tenant, then the alias, as activation does."""
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = rollout.lock_alias(adapter, alias)
    target.adapter = adapter
    if target.reserved == reserved:
        return target
    if reserved:
        capacity.check_reservation(adapter=adapter, alias=target)
    _set_reserved(target, reserved, by=by)
    live_event(
        tenant_id=adapter.tenant_id,
        type="alias.reserve",
        id=target.id,
        state="reserved" if reserved else "on_demand",
        adapter=adapter.name,
        alias=target.name,
        revision=revision_label(target.revision),
    )
    if reserved:
        transaction.on_commit(lambda: outbox.send("alias_converge", alias_id=target.id))
    return target


@transaction.atomic
def activation_cancel(*, adapter: Adapter, alias_name: str, by: Actor) -> Alias:
    """Withdraw an alias's pending activation (or rollback): its desired revision goes back to the live one.

    The withdrawn revision's placement requests that nothing else pins (no other alias names it) are dropped
    when they hold no work yet (`waiting`, `queued`: the row is deleted; a freed slot goes to what waits for one
    on the heartbeat's next `placements_retry`, within MINT_HEARTBEAT_S). A load
    already running (`loading`, `warming`) is left to finish: the node agent is mid-copy or mid-load, and
    interrupting it would leave files under a LoRA name vLLM may hold; once ready, nothing pins it, so it is
    the first to be evicted when a slot is needed (and serves `<adapter>@r<n>` meanwhile). Ready and failed
    placements stay as they are. 409 `nothing_to_cancel` when nothing is pending. Locks the tenant, then the
    alias, as activation does.
    """
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = rollout.lock_alias(adapter, alias_name)
    if target.desired_revision_id == target.revision_id:
        raise Conflict(
            f"{adapter.name}:{alias_name} has no pending activation: it wants what it serves "
            f"({revision_label(target.revision) or 'nothing'}).",
            code="nothing_to_cancel",
        )
    withdrawn = target.desired_revision
    before = {
        "revision": revision_label(target.revision),
        "desired": revision_label(withdrawn),
        "rollback": target.rollback_pending,
    }
    target.desired_revision = target.revision
    target.rollback_pending = False
    target.updated_by = by.label
    target.updated_at = timezone.now()
    target.save(update_fields=["desired_revision", "rollback_pending", "updated_by", "updated_at"])
    dropped = placements_withdraw(withdrawn)
    audit_record(
        tenant=adapter.tenant,
        actor=by,
        action="alias.cancel",
        target=f"alias:{adapter.name}:{target.name}",
        before=before,
        after={
            "revision": revision_label(target.revision),
            "desired": revision_label(target.revision),
            "withdrawn": dropped,
        },
    )
    live_event(
        tenant_id=adapter.tenant_id,
        type="alias.desired",
        id=target.id,
        state="cancelled",
        adapter=adapter.name,
        alias=target.name,
        revision=revision_label(target.revision),
        withdrawn=revision_label(withdrawn),
    )
    return target


# ---------------------------------------------------------------- convergence (called by tasks)


def converge_aliases(*, revision: AdapterRevision) -> list[Alias]:
    """Flip every alias that wants `revision` once it is ready on its adapter's replica count of up nodes."""
    flipped = []
    if selectors.ready_count(revision) < revision.adapter.replica_count:
        return flipped
    for alias in Alias.objects.filter(canary_revision=revision, canary_ready_at=None).select_related("adapter"):
        rollout.canary_ready(alias=alias)
    for alias in Alias.objects.filter(desired_revision=revision).exclude(revision=revision).select_related("adapter"):
        try:
            flipped.append(rollout.alias_flip(adapter=alias.adapter, revision=revision, alias=alias.name))
        except Conflict:
            continue  # the desired revision changed meanwhile
    return flipped


def alias_converge(*, alias: Alias) -> None:
    """Bring an alias to what it should serve on its adapter's replica count (`Adapter.replica_count`) of up nodes:
    its live revision topped up to that count, its desired one flipped to now if it is ready on that many, else
    prewarmed on that many, and the previous one topped up while its rollback grace lasts. An alias that is not
    reserved gets no top-ups: what it serves once flipped is on demand (loaded when asked for).

    A top-up counts placements in any state on up nodes, as the heartbeat's `placements_retry` does (a failed
    prewarm is not retried by itself): it only matters after the count was raised (`adapter_scale`) or a node
    went down since the last heartbeat.
    """
    count = alias.adapter.replica_count
    if alias.reserved:
        _top_up(alias.revision, count)
    desired = alias.desired_revision
    if desired is not None and desired.id != alias.revision_id:
        if selectors.ready_count(desired) >= count:
            converge_aliases(revision=desired)
        else:
            priority = Priority.ROLLBACK if alias.rollback_pending else Priority.ACTIVATION
            placement_request(revision=desired, priority=priority, replicas=count)
    until = alias.previous_pinned_until
    if alias.reserved and until is not None and until >= timezone.now():
        _top_up(alias.previous_revision, count)
    candidate = alias.canary_revision
    if candidate is not None:
        if selectors.ready_count(candidate) >= count:
            rollout.canary_ready(alias=alias)
        else:
            placement_request(revision=candidate, priority=Priority.ACTIVATION, replicas=count)


def _top_up(revision: AdapterRevision | None, count: int) -> None:
    if revision is None or revision.state != RevisionState.APPROVED or not revision.export_uri:
        return
    if Placement.objects.filter(revision=revision, node__state=NodeState.UP).count() < count:
        placement_request(revision=revision, priority=Priority.ACTIVATION, replicas=count)


@transaction.atomic
def adapter_scale(*, adapter: Adapter, replicas: int | None, by: Actor) -> Adapter:
    """Set how many distinct nodes the adapter's served revisions are placed on (`replicas`; None: the platform
    default), within the plan's `max_replicas` (429 `replicas_above_plan`), audited `adapter.replicas`.

    Then, after commit, each of its aliases converges on the new count (the `alias_converge` task): raised, the
    revisions they pin (live, desired, previous within the rollback grace) are placed on more nodes now, and a
    pending activation waits for that many; lowered, a pending activation already ready on enough nodes flips,
    and nothing is unloaded: the surplus replicas keep serving until their revision is no longer pinned, a
    tenant under its fair share takes their slot, or their node drains (failover tops up to the new count only).
    """
    before = adapter.replica_count
    adapter = adapter_set_replicas(adapter=adapter, replicas=replicas, by=by)
    if adapter.replica_count != before:
        for alias_id in Alias.objects.filter(adapter=adapter).values_list("id", flat=True):
            transaction.on_commit(lambda a=alias_id: outbox.send("alias_converge", alias_id=a))
    return adapter


def placement_ready(*, placement: Placement, warm_ms: float) -> bool:
    """Phase 2 of a prewarm done: the placement is routable, and aliases waiting for its revision flip."""
    if not placement_warmed(placement=placement, warm_ms=warm_ms):
        return False
    converge_aliases(revision=placement.revision)
    admit(node_id=placement.node_id)
    return True
