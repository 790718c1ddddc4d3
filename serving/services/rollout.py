"""How an alias moves to a revision: the flip, and a canary rollout before it.

`alias_flip` points an alias at its desired revision once the serving plane has it ready (serving/services/aliases.py
converges). `canary_start` (activation with `canary_percent`, 1 to 50) keeps the alias's live revision as it is and
names the candidate `Alias.canary_revision`: it is pinned (placed at activation priority on the adapter's replica
count, counted by the pinned-revision quota) and, once ready on that many up nodes (`canary_ready`), the gateway
sends `canary_percent` % of the alias's requests to it (serving/gateway/canary.py: by a hash of the caller's
`user`, else at random). `canary_promote` flips the alias to it (the usual flip: the previous revision is kept
through the rollback grace); `canary_abort` drops it (0 %) and releases its placements like a cancelled
activation. The gateway's counters and the rule that aborts a canary on a breach (`canary_abort_auto`) are in
serving/services/canary.py.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, RevisionState
from adapters.models.catalog import revision_label
from mint_site.errors import Conflict, InvalidTransition, NotFound
from mint_site.events import epoch_us, live_event
from serving import selectors
from serving.models import Alias
from serving.services import canary, capacity, outbox
from serving.services.placement import placements_withdraw
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)


def _target(alias: Alias) -> str:
    return f"alias:{alias.adapter.name}:{alias.name}"


def _event(alias: Alias, state: str, *, revision: AdapterRevision | None, percent: int | None, **fields) -> None:
    live_event(
        tenant_id=alias.adapter.tenant_id,
        type="canary.state",
        id=alias.id,
        state=state,
        adapter=alias.adapter.name,
        alias=alias.name,
        revision=revision_label(revision),
        percent=percent,
        **fields,
    )


def lock_alias(adapter: Adapter, name: str, *, create: bool = False) -> Alias:
    """The adapter's alias `name`, row-locked (created first with `create`); 404 `alias_not_found`. In a
    transaction."""
    alias = Alias.objects.select_for_update().filter(adapter=adapter, name=name).first()
    if alias is None and create:
        try:
            with transaction.atomic():
                Alias.objects.create(adapter=adapter, name=name)
        except IntegrityError:
            pass  # created concurrently; lock it below
        alias = Alias.objects.select_for_update().get(adapter=adapter, name=name)
    if alias is None:
        raise NotFound(f"{adapter.name} has no alias {name!r}.", code="alias_not_found")
    alias.adapter = adapter
    return alias


# ---------------------------------------------------------------- the flip


@transaction.atomic
def alias_flip(
    *, adapter: Adapter, revision: AdapterRevision, alias: str = Alias.PRODUCTION, by: Actor | None = None
) -> Alias:
    """Point `alias` at its desired `revision`, atomically. Called by the serving plane once it is ready."""
    target = lock_alias(adapter, alias)
    if target.desired_revision_id != revision.id:
        raise InvalidTransition(
            f"{adapter.name}:{alias} wants {revision_label(target.desired_revision)}, not r{revision.number}.",
            code="not_desired",
        )
    if target.revision_id == revision.id:
        return target
    before = {"revision": revision_label(target.revision)}
    target.previous_revision = target.revision
    target.revision = revision
    target.rollback_pending = False
    target.updated_at = timezone.now()
    target.previous_pinned_until = target.updated_at + timedelta(seconds=settings.MINT_ROLLBACK_GRACE_S)
    target.save(
        update_fields=["previous_revision", "revision", "rollback_pending", "updated_at", "previous_pinned_until"]
    )
    audit_record(
        tenant=adapter.tenant,
        actor=by or Actor.system(),
        action="alias.flip",
        target=f"alias:{adapter.name}:{alias}",
        before=before,
        after={"revision": revision_label(revision)},
    )
    live_event(
        tenant_id=adapter.tenant_id,
        type="alias.flip",
        id=target.id,
        state="live",
        adapter=adapter.name,
        alias=alias,
        revision=revision_label(revision),
    )
    return target


# ---------------------------------------------------------------- start, promote, abort


@transaction.atomic
def canary_start(
    *, adapter: Adapter, revision: AdapterRevision, percent: int, by: Actor, alias: str = Alias.PRODUCTION
) -> Alias:
    """Send `percent` % of `alias`'s requests to `revision` once it is ready; the alias keeps serving its live
    revision for the rest. Asking again for the same candidate changes its percent (its counters go on).

    409 when the alias serves nothing yet (`canary_needs_live`: there is nothing to compare with), when it
    serves `revision` already (`canary_is_live`), when an activation or rollback is pending
    (`activation_pending`), or when another canary runs (`canary_active`: promote or abort it first).
    429 past the pinned-revision quota: the candidate is one more pinned revision. Locks the tenant, then the
    alias, as activation does.
    """
    canary.check_percent(percent)
    if revision.state != RevisionState.APPROVED:
        raise InvalidTransition(
            f"r{revision.number} is {revision.state}; only approved revisions can be activated.",
            detail={"state": revision.state},
        )
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = Alias.objects.select_for_update().filter(adapter=adapter, name=alias).first()
    if target is None or target.revision_id is None:
        raise Conflict(
            f"{adapter.name}:{alias} serves no revision yet: a canary needs a live revision to compare with. "
            "Activate without canary_percent first.",
            code="canary_needs_live",
        )
    target.adapter = adapter
    if target.revision_id == revision.id:
        raise Conflict(f"{adapter.name}:{alias} serves r{revision.number} already.", code="canary_is_live")
    if target.desired_revision_id != target.revision_id:
        raise Conflict(
            f"{adapter.name}:{alias} has a pending activation of {revision_label(target.desired_revision)}; "
            "cancel it or let it finish before starting a canary.",
            code="activation_pending",
        )
    if target.canary_revision_id not in (None, revision.id):
        raise Conflict(
            f"{adapter.name}:{alias} runs a canary of {revision_label(target.canary_revision)} already; "
            "promote or abort it first.",
            code="canary_active",
        )
    if target.canary_revision_id == revision.id:
        if target.canary_percent == percent:
            return target
        before = {"canary": revision_label(revision), "percent": target.canary_percent}
        target.canary_percent = percent
        target.save(update_fields=["canary_percent"])
        audit_record(
            tenant=adapter.tenant,
            actor=by,
            action="canary.start",
            target=_target(target),
            before=before,
            after={"canary": revision_label(revision), "percent": percent},
        )
        if target.canary_ready_at is not None:
            _event(target, "started", revision=revision, percent=percent)
        return target
    capacity.check_canary_pin(adapter=adapter, revision=revision)
    now = timezone.now()
    target.canary_revision = revision
    target.canary_percent = percent
    target.canary_started_at = now
    target.canary_ready_at = None
    target.canary_by = by.label
    target.save(
        update_fields=["canary_revision", "canary_percent", "canary_started_at", "canary_ready_at", "canary_by"]
    )
    audit_record(
        tenant=adapter.tenant,
        actor=by,
        action="canary.start",
        target=_target(target),
        before={"revision": revision_label(target.revision), "canary": None},
        after={"revision": revision_label(target.revision), "canary": revision_label(revision), "percent": percent},
    )
    transaction.on_commit(lambda: outbox.send("alias_converge", alias_id=target.id))
    return target


def canary_ready(*, alias: Alias) -> bool:
    """The candidate is ready on the replica count: the alias begins sending it its share (a `started` event the
    gateways follow). True if this call began it."""
    revision = alias.canary_revision
    if revision is None or alias.canary_ready_at is not None:
        return False
    if selectors.ready_count(revision) < alias.adapter.replica_count:
        return False
    now = timezone.now()
    began = Alias.objects.filter(
        id=alias.id, canary_revision=revision, canary_started_at=alias.canary_started_at, canary_ready_at=None
    ).update(canary_ready_at=now)
    if began:
        alias.canary_ready_at = now
        _event(alias, "started", revision=revision, percent=alias.canary_percent)
    return bool(began)


def _clear(target: Alias) -> None:
    target.canary_revision = None
    target.canary_percent = None
    target.canary_started_at = None
    target.canary_ready_at = None
    target.canary_by = ""
    target.save(
        update_fields=["canary_revision", "canary_percent", "canary_started_at", "canary_ready_at", "canary_by"]
    )


def _no_canary(adapter: Adapter, alias: str) -> Conflict:
    return Conflict(f"{adapter.name}:{alias} runs no canary.", code="no_canary")


@transaction.atomic
def canary_promote(*, adapter: Adapter, by: Actor, alias: str = Alias.PRODUCTION) -> Alias:
    """Make the candidate the alias's revision: it flips at once when ready on the replica count (the previous
    revision is kept through the rollback grace), else when it is (the usual activation). 409 `no_canary`."""
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = lock_alias(adapter, alias)
    candidate, percent = target.canary_revision, target.canary_percent
    if candidate is None:
        raise _no_canary(adapter, alias)
    if candidate.state != RevisionState.APPROVED:
        raise InvalidTransition(
            f"r{candidate.number} is {candidate.state}; only approved revisions can be promoted.",
            detail={"state": candidate.state},
        )
    counts = canary.canary_counts(alias=target)
    _clear(target)
    target.desired_revision = candidate
    target.rollback_pending = False
    target.updated_by = by.label
    target.updated_at = timezone.now()
    target.save(update_fields=["desired_revision", "rollback_pending", "updated_by", "updated_at"])
    audit_record(
        tenant=adapter.tenant,
        actor=by,
        action="canary.promote",
        target=_target(target),
        before={"revision": revision_label(target.revision), "canary": revision_label(candidate), "percent": percent},
        after={"revision": revision_label(target.revision), "desired": revision_label(candidate), "counts": counts},
    )
    _event(target, "promoted", revision=candidate, percent=percent)
    if selectors.ready_count(candidate) >= adapter.replica_count:
        target = alias_flip(adapter=adapter, revision=candidate, alias=alias, by=by)
    else:
        transaction.on_commit(lambda: outbox.send("alias_converge", alias_id=target.id))
    return target


def abort_locked(target: Alias, *, by: Actor, reason: str) -> None:
    """Abort the canary of an alias the caller holds locked (with its tenant), e.g. for a rollback."""
    _abort(target, by=by, reason=reason, counts=canary.canary_counts(alias=target))


def _abort(target: Alias, *, by: Actor, reason: str, counts: dict | None) -> None:
    candidate, percent = target.canary_revision, target.canary_percent
    _clear(target)
    withdrawn = placements_withdraw(candidate)
    audit_record(
        tenant=target.adapter.tenant,
        actor=by,
        action="canary.abort",
        target=_target(target),
        before={"revision": revision_label(target.revision), "canary": revision_label(candidate), "percent": percent},
        after={
            "revision": revision_label(target.revision),
            "canary": None,
            "reason": reason,
            "counts": counts,
            "withdrawn": withdrawn,
        },
    )
    _event(target, "aborted", revision=candidate, percent=0, reason=reason)


@transaction.atomic
def canary_abort(*, adapter: Adapter, by: Actor, alias: str = Alias.PRODUCTION, reason: str = "") -> Alias:
    """Drop the canary (0 %): every request goes to the live revision, and the candidate's placements that no
    other alias pins are released like a cancelled activation's. 409 `no_canary` when none runs."""
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = lock_alias(adapter, alias)
    if target.canary_revision is None:
        raise _no_canary(adapter, alias)
    _abort(target, by=by, reason=reason[:500] or f"aborted by {by.label}", counts=canary.canary_counts(alias=target))
    return target


def canary_abort_auto(
    *, alias_id: int, started_us: int, reason: str, counts: dict | None, stranded: bool = False
) -> bool:
    """The canary that began at `started_us` must end: the gateway saw it breach its margin, or (`stranded`) nobody
    can reach its candidate. Abort it, audited with the reason and the counts (None: read them now), by the
    system. Idempotent: False when that canary is gone already (aborted, promoted, or replaced by a later one), or,
    `stranded`, when its candidate is reachable again by the time the alias is locked; so any number of gateway
    processes and heartbeats may ask."""
    with transaction.atomic():
        alias = Alias.objects.select_related("adapter").filter(id=alias_id).first()
        if alias is None:
            return False
        alias.adapter.tenant = capacity.lock_tenant(alias.adapter.tenant_id)
        target = (
            Alias.objects.select_for_update(of=("self",)).select_related("canary_revision", "revision").get(id=alias_id)
        )
        target.adapter = alias.adapter
        if target.canary_started_at is None or epoch_us(target.canary_started_at) != started_us:
            return False
        if stranded and not selectors.stranded_canaries().filter(id=alias_id).exists():
            return False
        _abort(
            target,
            by=Actor.system(),
            reason=reason,
            counts=canary.canary_counts(alias=target) if counts is None else counts,
        )
    log.warning("canary of alias %s aborted: %s", alias_id, reason)
    return True


def canaries_stranded_abort(*, base_model_id: int | None = None, limit: int = 100) -> int:
    """Abort every routing canary whose candidate nobody can reach (`selectors.stranded_canaries`); how many.

    Its share of requests is served by the live revision meanwhile and counted as the candidate's errors, but
    whether those reach the error rule before failover could place the candidate again elsewhere was a race (a
    prewarm takes a fraction of a second). A canary measures its candidate where it was placed: one that lost
    every placement is over, whatever its counters say, and failover never places it again
    (`placement.placements_retry`). Called wherever that can begin, before failover places anything: when a
    node is marked down (the gateway's probe, the heartbeat) and after each heartbeat's reconcile (an engine
    that restarted and lost the candidate), so no canary runs stranded for longer than one heartbeat.
    """
    stranded = selectors.stranded_canaries(base_model_id=base_model_id).values_list(
        "id", "canary_started_at", "canary_revision__number"
    )
    aborted = 0
    for alias_id, started_at, number in stranded[:limit]:
        reason = (
            f"{canary.UNREACHABLE}: r{number} has no ready placement on a node that serves "
            "(its node went down or its engine lost it)"
        )
        aborted += canary_abort_auto(
            alias_id=alias_id, started_us=epoch_us(started_at), reason=reason, counts=None, stranded=True
        )
    return aborted
