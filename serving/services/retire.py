"""Retiring what a tenant no longer serves: deactivate an alias, archive a revision, delete an adapter.

Each locks the tenant row first (as activation does), so an activation cannot name a revision while it is being
archived, nor an alias come back while its adapter is deleted. What names a revision is checked here (aliases and
canaries are serving state); the catalog's side (state, files, storage counters) is adapters.services.retirement.

A revision nothing names any more leaves the nodes (`revision_leave_nodes`): its placements are withdrawn or
unloaded (serving.services.placement.placements_release) and, once archived, its copies on the nodes' disks go
too. Roles as for activation: the DECIDE capability (approvers, owners, deploy keys).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from adapters.models import RevisionState as S
from adapters.models.catalog import revision_label
from adapters.services import retirement
from mint_site.errors import Conflict, NotFound
from mint_site.events import live_event
from serving.models import Alias, NodeCopy, Placement, ServingNode, lora_name
from serving.services import capacity, outbox, rollout
from serving.services.failover import placements_release
from tenants.access import Actor
from tenants.services import audit_record

log = logging.getLogger(__name__)

# The most times `revision_leave_nodes` comes back for loads that were under way when it first ran.
LEAVE_ATTEMPTS = 20
LEAVE_RETRY_S = 15.0


def naming_aliases(revision: AdapterRevision, *, now=None) -> list[str]:
    """The aliases that name `revision`, as people read them: `production (live)`, `candidate (canary)`, …: live,
    desired, canary, and previous while its rollback grace lasts."""
    now = now or timezone.now()
    rows = Alias.objects.filter(
        Q(revision=revision)
        | Q(desired_revision=revision)
        | Q(canary_revision=revision)
        | Q(previous_revision=revision, previous_pinned_until__gte=now)
    ).values_list("name", "revision_id", "desired_revision_id", "canary_revision_id")
    named = []
    for name, live, desired, candidate in rows.order_by("name"):
        role = (
            "live"
            if live == revision.id
            else "canary"
            if candidate == revision.id
            else "desired"
            if desired == revision.id
            else "previous, in its rollback grace"
        )
        named.append(f"{name} ({role})")
    return named


def _leave_nodes_on_commit(revision_ids: list[int]) -> None:
    for revision_id in revision_ids:
        transaction.on_commit(lambda r=revision_id: outbox.send("revision_leave_nodes", revision_id=r))


def revision_leave_nodes(*, revision_id: int, attempt: int = 0) -> dict[str, list[str]] | None:
    """Take a revision off the nodes unless an alias names it again meanwhile (`placements_release`); once it is
    archived, also forget its copies on the nodes' disks and have each node remove the files after the unload
    grace. Comes back (the task, LEAVE_RETRY_S later) while loads of it are under way. None: it stays."""
    revision = AdapterRevision.objects.select_related("adapter__tenant").filter(id=revision_id).first()
    if revision is None or naming_aliases(revision):
        return None
    released = placements_release(revision=revision)
    if released["loading"] and attempt < LEAVE_ATTEMPTS:
        transaction.on_commit(
            lambda: outbox.send(
                "revision_leave_nodes", countdown=LEAVE_RETRY_S, revision_id=revision_id, attempt=attempt + 1
            )
        )
    if revision.state == S.ARCHIVED:
        _forget_node_copies(revision)
    return released


def _forget_node_copies(revision: AdapterRevision) -> None:
    """The node-disk tier of an archived revision: its records go now, its files once unloaded (the agent's
    `node_cache_cleanup` removes them only when vLLM no longer lists the name and nothing placed it again)."""
    nodes = set(NodeCopy.objects.filter(revision=revision).values_list("node_id", flat=True))
    nodes |= set(Placement.objects.filter(revision=revision).values_list("node_id", flat=True))
    NodeCopy.objects.filter(revision=revision).delete()
    name = lora_name(revision)
    for node in ServingNode.objects.filter(id__in=nodes):
        transaction.on_commit(
            lambda n=node: outbox.send(
                "node_cache_cleanup", queue=n.queue, countdown=settings.MINT_NODE_FILE_GRACE_S, node_id=n.id, name=name
            )
        )


# ---------------------------------------------------------------- deactivate an alias


@transaction.atomic
def alias_deactivate(*, adapter: Adapter, alias_name: str, by: Actor) -> list[str]:
    """Take an alias down: its requests answer 404 `model_not_found` from now on, a canary on it ends, a pending
    activation is withdrawn, and each revision it named leaves the nodes unless another alias names it. Audited
    `alias.deactivate` with what it named; a live event and webhook `alias.deactivated`. Returns the revisions it
    named. 404 `alias_not_found`. Activating again creates it anew.
    """
    adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
    target = (
        Alias.objects.select_for_update(of=("self",))
        .select_related("revision", "desired_revision", "previous_revision", "canary_revision")
        .filter(adapter=adapter, name=alias_name)
        .first()
    )
    if target is None:
        raise NotFound(f"{adapter.name} has no alias {alias_name!r}.", code="alias_not_found")
    target.adapter = adapter
    before = {
        "revision": revision_label(target.revision),
        "desired": revision_label(target.desired_revision),
        "previous": revision_label(target.previous_revision),
        "canary": revision_label(target.canary_revision),
    }
    named = [
        r
        for r in (target.revision, target.desired_revision, target.previous_revision, target.canary_revision)
        if r is not None
    ]
    if target.canary_revision_id is not None:
        rollout.abort_locked(target, by=by, reason=f"{adapter.name}:{alias_name} deactivated")
    alias_id = target.id
    target.delete()
    audit_record(
        tenant=adapter.tenant,
        actor=by,
        action="alias.deactivate",
        target=f"alias:{adapter.name}:{alias_name}",
        before=before,
        after={"deactivated": True},
    )
    live_event(
        tenant_id=adapter.tenant_id,
        type="alias.state",
        id=alias_id,
        state="deactivated",
        adapter=adapter.name,
        alias=alias_name,
        revision=before["revision"],
    )
    ids = sorted({r.id for r in named})
    _leave_nodes_on_commit(ids)
    return sorted({r.label for r in named}, key=lambda label: int(label[1:]))


# ---------------------------------------------------------------- archive a revision


def _refuse_named(revision: AdapterRevision, names: list[str]) -> None:
    if names:
        adapter = revision.adapter.name
        raise Conflict(
            f"r{revision.number} of {adapter} is named by alias {', '.join(names)}: move or deactivate "
            f"{'that alias' if len(names) == 1 else 'those aliases'} first.",
            code="revision_in_use",
            detail={"aliases": [n.split(" ", 1)[0] for n in names], "named_as": names},
        )


def revision_archive(
    *, revision: AdapterRevision, by: Actor, keep_source: bool = False, reason: str = ""
) -> AdapterRevision:
    """Archive a revision nothing names: 409 `revision_in_use` naming each alias (live, desired, canary, or
    previous within its rollback grace) that still does. Its files are collected from the store (the source too
    unless `keep_source`) and it leaves the nodes; row, policy record, audit trail and usage stay
    (adapters.services.retirement.revision_archive). A live event and webhook `revision.archived`."""
    with transaction.atomic():
        capacity.lock_tenant(revision.adapter.tenant_id)  # against an activation naming it meanwhile
        _refuse_named(revision, naming_aliases(revision))
        archived = retirement.revision_archive(revision=revision, by=by, keep_source=keep_source, reason=reason)
        _leave_nodes_on_commit([revision.id])
    return archived


# ---------------------------------------------------------------- delete an adapter


@dataclass(frozen=True)
class Deleted:
    adapter: str
    archived: list[str]


def adapter_delete(*, adapter: Adapter, by: Actor) -> Deleted:
    """Delete an adapter: only with no live alias (409 `adapter_in_use` naming them: deactivate them first) and no
    revision still being validated or exported (409 `revisions_in_flight`). Aliases that never went live are
    removed, open resumable uploads aborted, and every revision archived (marked `keep` or not; files collected,
    rows kept). The adapter's row stays, hidden, and its name is not given to a new adapter. Audited
    `adapter.delete`; a live event and webhook `adapter.deleted`."""
    with transaction.atomic():
        adapter.tenant = capacity.lock_tenant(adapter.tenant_id)
        aliases = list(Alias.objects.select_for_update().filter(adapter=adapter).order_by("name"))
        live = [a.name for a in aliases if a.revision_id is not None or a.canary_revision_id is not None]
        if live:
            raise Conflict(
                f"{adapter.name} still serves alias {', '.join(live)}: deactivate "
                f"{'it' if len(live) == 1 else 'them'} first.",
                code="adapter_in_use",
                detail={"aliases": live},
            )
        busy = list(
            AdapterRevision.objects.filter(adapter=adapter, state__in=(S.REGISTERED, S.VALIDATED))
            .order_by("number")
            .values_list("number", flat=True)[:20]
        )
        if busy:
            raise Conflict(
                f"{adapter.name} has revisions still being validated or exported ({', '.join(f'r{n}' for n in busy)})"
                "; delete it once they are done.",
                code="revisions_in_flight",
                detail={"revisions": [f"r{n}" for n in busy]},
            )
        pending = [a for a in aliases if a.desired_revision_id is not None]
        for alias in aliases:
            alias.delete()
        _leave_nodes_on_commit(sorted({a.desired_revision_id for a in pending}))
        archived = []
        for revision in AdapterRevision.objects.filter(
            adapter=adapter, state__in=retirement.ARCHIVABLE_STATES
        ).order_by("number"):
            revision.adapter = adapter
            retirement.revision_archive(revision=revision, by=by, reason="adapter deleted", ignore_keep=True)
            archived.append(revision.id)
        _leave_nodes_on_commit(archived)
        _abort_uploads(adapter, by)
        retirement.adapter_mark_deleted(adapter=adapter, by=by, archived=[f"r{n}" for n in _numbers(archived)])
    return Deleted(adapter=adapter.name, archived=[f"r{n}" for n in _numbers(archived)])


def _numbers(revision_ids: list[int]) -> list[int]:
    return sorted(AdapterRevision.objects.filter(id__in=revision_ids).values_list("number", flat=True))


def _abort_uploads(adapter: Adapter, by: Actor) -> None:
    from adapters import uploads
    from adapters.models import UploadSession, UploadState

    for session in UploadSession.objects.filter(adapter=adapter, state=UploadState.OPEN).select_related(
        "adapter__tenant"
    ):
        uploads.upload_session_abort(session=session, by=by)
