"""The catalog's side of retiring: archiving a revision (its files collected, its row kept), restoring one from a
source that was kept, marking one `keep`, editing an adapter's description, tags and retention, and marking a
deleted adapter.

What names a revision (aliases, canaries) and what holds it loaded (placements, node disks) is serving state:
serving.services.retire checks and releases those, then calls these. Each write here is audited and sent as a
live event after commit; files are removed from the store after the row says so (a store that fails then leaves
files nobody refers to, logged, rather than a row that refers to files that are gone).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from adapters import collect, store
from adapters.models import Adapter, AdapterRevision
from adapters.models import RevisionState as S
from adapters.services.registration import check_storage_quota
from adapters.services.transitions import revision_ensure_export
from adapters.states import audit_target, revision_transition
from mint_site.errors import Conflict, InvalidTransition, MintError, QuotaExceeded
from mint_site.events import live_event
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)

# What may be archived: a revision whose work is over. Registered and validated ones are still being checked and
# exported (their tasks would race the collection); an archived one is archived already.
ARCHIVABLE_STATES = (S.EXPORTED, S.PENDING_APPROVAL, S.APPROVED, S.REJECTED, S.FAILED)
# The state a restored revision returns to: its frozen export is written again, and a decision is not revived
# (a pending request for approval is asked again by whoever wants it).
RESTORED_TO = {S.EXPORTED: S.EXPORTED, S.PENDING_APPROVAL: S.EXPORTED, S.APPROVED: S.APPROVED}

TAG = re.compile(r"^[a-z0-9][a-z0-9._:-]{0,31}$")
MAX_TAGS = 16
MAX_DESCRIPTION = 2000


@dataclass(frozen=True)
class Freed:
    """What an archive took off the tenant's storage counters."""

    bytes: int
    revisions: int


def _freed(revision: AdapterRevision, *, keep_source: bool) -> Freed:
    """Bytes and revisions an archive frees: the export unless already collected, and the source unless kept."""
    if revision.purged_at is not None:
        return Freed(0, 0)  # a failed or rejected revision collected already: nothing of it is counted
    if keep_source:
        return Freed(revision.export_bytes, 0)
    return Freed(revision.size_bytes + revision.export_bytes, 1)


def revision_archive(
    *, revision: AdapterRevision, by: Actor, keep_source: bool = False, reason: str = "", ignore_keep: bool = False
) -> AdapterRevision:
    """Archive a revision: state `archived`, its export collected from the store, and its source too unless
    `keep_source` (then it can be restored: `revision_restore`). The row, policy record, approvals, evaluations,
    audit trail and usage stay; the tenant's storage counters fall by what was removed.

    For serving.services.revision_archive (which first refuses a revision an alias or canary names and then takes
    it off the nodes) and retention. 409 `invalid_transition` outside ARCHIVABLE_STATES; 409 `revision_kept` for a
    revision marked `keep` (unless `ignore_keep`: the adapter is being deleted).
    """
    with transaction.atomic():
        current = AdapterRevision.objects.select_for_update().select_related("adapter__tenant").get(id=revision.id)
        if current.keep and not ignore_keep and current.state in ARCHIVABLE_STATES:
            raise Conflict(
                f"r{current.number} of {current.adapter.name} is marked keep: unmark it first to archive it.",
                code="revision_kept",
            )
        freed = _freed(current, keep_source=keep_source)
        now = timezone.now()
        source_removed = not keep_source and current.purged_at is None
        revision_transition(
            current,
            to=S.ARCHIVED,
            sources=ARCHIVABLE_STATES,
            by=by,
            action="archive",
            extra_after={
                "from": current.state,
                "source": "kept" if keep_source else "removed",
                "bytes_freed": freed.bytes,
                **({"reason": reason} if reason else {}),
            },
            archived_at=now,
            archived_from=current.state,
            **({"purged_at": now} if source_removed else {}),
        )
        Tenant.objects.filter(id=current.adapter.tenant_id).update(
            stored_bytes=Greatest(F("stored_bytes") - freed.bytes, 0),
            stored_revisions=Greatest(F("stored_revisions") - freed.revisions, 0),
        )
    prefixes = collect.owned_prefixes(current, source=not keep_source)

    def remove() -> None:
        try:
            store.delete_prefixes(prefixes)
        except Exception:  # the row is archived already; files nobody refers to are only space
            log.warning("archived %s but could not remove %s", current, prefixes, exc_info=True)

    transaction.on_commit(remove)  # at once outside a transaction; else once the caller's commits
    return current


def _source_is_there(revision: AdapterRevision) -> bool:
    source = revision.source_uri
    return bool(source) and (bool(store.list_files(source)) or store.exists(source))


@transaction.atomic
def revision_restore(*, revision: AdapterRevision, by: Actor) -> AdapterRevision:
    """archived → the state it left (exported, or approved; a pending request for approval comes back exported),
    its frozen export written again from its source (`revision_ensure_export`), byte for byte as recorded.

    Only while its source is still in the store (archived with `keep_source`, or registered from the tenant's own
    incoming area and still there): else 409 `source_gone`. A failed or rejected revision is not restored (409
    `not_restorable`: register it again). Counts against the storage quota again (429 past it).
    """
    current = AdapterRevision.objects.select_for_update().select_related("adapter__tenant").get(id=revision.id)
    label = f"r{current.number} of {current.adapter.name}"
    if current.state != S.ARCHIVED:
        raise InvalidTransition(
            f"{label} is {current.state}; restore needs archived.",
            detail={"state": current.state, "allowed_from": [S.ARCHIVED]},
        )
    to = RESTORED_TO.get(current.archived_from)
    if to is None:
        raise Conflict(
            f"{label} was {current.archived_from or 'in no known state'} when archived; only a revision that was "
            "exported or approved is restored. Register its files again instead.",
            code="not_restorable",
            detail={"archived_from": current.archived_from},
        )
    if not _source_is_there(current):
        raise Conflict(
            f"{label} cannot be restored: its source was removed when it was archived. Register its files again "
            "(archive with keep_source to keep a revision restorable).",
            code="source_gone",
            detail={"source_uri": current.source_uri},
        )
    tenant = Tenant.objects.select_for_update().get(id=current.adapter.tenant_id)
    recount = current.purged_at is not None
    adding = current.export_bytes + (current.size_bytes if recount else 0)
    if recount:
        check_storage_quota(tenant, adding_bytes=adding)
    elif tenant.stored_bytes + adding > tenant.max_storage_bytes:
        raise QuotaExceeded(
            f"Restoring {label} writes {adding} bytes again; tenant {tenant.slug} stores {tenant.stored_bytes} of "
            f"its {tenant.max_storage_bytes} (max_storage_bytes). Archive something else first.",
            code="storage_quota_exceeded",
            detail={"stored_bytes": tenant.stored_bytes, "max_storage_bytes": tenant.max_storage_bytes},
        )
    Tenant.objects.filter(id=tenant.id).update(
        stored_bytes=F("stored_bytes") + adding, stored_revisions=F("stored_revisions") + (1 if recount else 0)
    )
    revision_transition(
        current,
        to=to,
        sources=[S.ARCHIVED],
        by=by,
        action="restore",
        extra_after={"from": S.ARCHIVED, "export": "rebuilding from the source"},
        event_fields={"restored": True},
        archived_at=None,
        archived_from="",
        purged_at=None,
    )
    revision_ensure_export(revision=current)
    return current


@transaction.atomic
def revision_set_keep(*, revision: AdapterRevision, keep: bool, by: Actor) -> AdapterRevision:
    """Mark (or unmark) a revision `keep`: retention never archives it. Audited `revision.keep` when it changes."""
    current = AdapterRevision.objects.select_for_update().select_related("adapter__tenant").get(id=revision.id)
    if current.state == S.ARCHIVED and keep:
        raise InvalidTransition(
            f"r{current.number} of {current.adapter.name} is archived; restore it before marking it keep.",
            detail={"state": current.state},
        )
    if current.keep != keep:
        AdapterRevision.objects.filter(id=current.id).update(keep=keep, updated_at=timezone.now())
        audit_record(
            tenant=current.adapter.tenant,
            actor=by,
            action="revision.keep",
            target=audit_target(current),
            before={"keep": current.keep},
            after={"keep": keep},
        )
        live_event(
            tenant_id=current.adapter.tenant_id,
            type="revision.keep",
            id=current.id,
            state="kept" if keep else "unkept",
            adapter=current.adapter.name,
            revision=current.label,
        )
    revision.keep = keep
    return revision


def clean_tags(tags: Any) -> list[str]:
    """Tags as stored: distinct, sorted, each 1-32 of a-z 0-9 . _ : - (starting with a letter or digit), at most
    MAX_TAGS; else 400 naming the bad one."""
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise MintError("tags: a list of strings.", detail={"tags": ["must be a list of strings"]})
    cleaned = sorted({t.strip().lower() for t in tags if t.strip()})
    bad = [t for t in cleaned if not TAG.match(t)]
    if bad:
        raise MintError(
            f"tags: {bad[0][:40]!r} is not a tag; use 1-32 lowercase letters, digits, '.', '_', ':' or '-'.",
            detail={"tags": [f"invalid: {t[:40]}" for t in bad[:5]]},
        )
    if len(cleaned) > MAX_TAGS:
        raise MintError(f"tags: at most {MAX_TAGS} tags, not {len(cleaned)}.", detail={"tags": ["too many"]})
    return cleaned


@transaction.atomic
def adapter_update(
    *, adapter: Adapter, by: Actor, description: str | None = None, tags: list[str] | None = None
) -> Adapter:
    """Change an adapter's description and/or tags (None: unchanged). Audited `adapter.update` with what changed."""
    locked = Adapter.objects.select_for_update(of=("self",)).select_related("tenant", "base_model").get(id=adapter.id)
    changes: dict[str, Any] = {}
    if description is not None:
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
            raise MintError(
                f"description: text of at most {MAX_DESCRIPTION} characters.", detail={"description": ["too long"]}
            )
        changes["description"] = description.strip()
    if tags is not None:
        changes["tags"] = clean_tags(tags)
    changed = {name: value for name, value in changes.items() if getattr(locked, name) != value}
    if changed:
        before = {name: getattr(locked, name) for name in changed}
        for name, value in changed.items():
            setattr(locked, name, value)
        locked.save(update_fields=list(changed))
        audit_record(
            tenant=locked.tenant,
            actor=by,
            action="adapter.update",
            target=f"adapter:{locked.name}",
            before=before,
            after=changed,
        )
        live_event(tenant_id=locked.tenant_id, type="adapter.state", id=locked.id, state="updated", adapter=locked.name)
    return locked


@transaction.atomic
def adapter_set_retention(*, adapter: Adapter, keep_last: int | None, grace_days: int | None, by: Actor) -> Adapter:
    """Set the adapter's own retention policy (None: the tenant plan's). Audited `adapter.retention` on change."""
    for name, value in (("keep_last", keep_last), ("grace_days", grace_days)):
        minimum = 1 if name == "keep_last" else 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise MintError(
                f"{name}: a whole number of at least {minimum}, or null for the tenant plan's.",
                detail={name: [f"must be ≥ {minimum} or null"]},
            )
    locked = Adapter.objects.select_for_update(of=("self",)).select_related("tenant", "base_model").get(id=adapter.id)
    before = {"keep_last": locked.retention_keep_last, "grace_days": locked.retention_grace_days}
    after = {"keep_last": keep_last, "grace_days": grace_days}
    if before != after:
        locked.retention_keep_last, locked.retention_grace_days = keep_last, grace_days
        locked.save(update_fields=["retention_keep_last", "retention_grace_days"])
        audit_record(
            tenant=locked.tenant,
            actor=by,
            action="adapter.retention",
            target=f"adapter:{locked.name}",
            before=before,
            after=after,
        )
    return locked


def adapter_mark_deleted(*, adapter: Adapter, by: Actor, archived: list[str]) -> Adapter:
    """Mark an adapter deleted (serving.services.adapter_delete archived its revisions and took its aliases down
    first). Its row stays, hidden from `Adapter.objects`; its name is not given to another adapter. Call inside
    the caller's transaction."""
    now = timezone.now()
    Adapter.all_objects.filter(id=adapter.id, deleted_at__isnull=True).update(deleted_at=now)
    adapter.deleted_at = now
    audit_record(
        tenant=adapter.tenant,
        actor=by,
        action="adapter.delete",
        target=f"adapter:{adapter.name}",
        before={"base_model": adapter.base_model.name, "description": adapter.description},
        after={"deleted": True, "archived": archived[:200], "archived_count": len(archived)},
    )
    live_event(tenant_id=adapter.tenant_id, type="adapter.state", id=adapter.id, state="deleted", adapter=adapter.name)
    return adapter
