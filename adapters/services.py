"""Writes for adapters and revisions: registration, the lifecycle transitions, approval, activation, rollback.

Every transition is a conditional update on the current state (one row or
`InvalidTransition`) plus an audit event in the same transaction. Work on files
and the artifact store happens outside transactions; Celery work is enqueued on commit.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from adapters import dispatch, selectors, store
from adapters.models import Adapter, AdapterRevision, Alias, Approval, BaseModel
from adapters.models import RevisionState as S
from mint_site.errors import Conflict, Forbidden, InvalidTransition, MintError, NotFound, PayloadTooLarge, QuotaExceeded
from tenants.access import Actor
from tenants.events import epoch_us, live_event
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)


def _target(revision: AdapterRevision) -> str:
    return f"revision:{revision.adapter.name}@r{revision.number}"


def _transition(
    revision: AdapterRevision,
    *,
    to: str,
    sources: Sequence[str],
    by: Actor,
    action: str,
    extra_after: dict[str, Any] | None = None,
    **fields: Any,
) -> AdapterRevision:
    """Move `revision` from one of `sources` to `to`, or raise InvalidTransition. Call inside a transaction."""
    now = timezone.now()
    changed = AdapterRevision.objects.filter(id=revision.id, state__in=sources).update(
        state=to, updated_at=now, **fields
    )
    if changed != 1:
        current = AdapterRevision.objects.filter(id=revision.id).values_list("state", flat=True).first()
        raise InvalidTransition(
            f"r{revision.number} of {revision.adapter.name} is {current}; {action} needs {' or '.join(sources)}.",
            detail={"state": current, "allowed_from": list(sources), "to": to},
        )
    before = revision.state
    revision.state = to
    revision.updated_at = now
    for name, value in fields.items():
        setattr(revision, name, value)
    audit_record(
        tenant=revision.adapter.tenant,
        actor=by,
        action=f"revision.{action}",
        target=_target(revision),
        before={"state": before},
        after={"state": to, **(extra_after or {})},
    )
    failure = (
        {"failure_code": revision.failure_code, "failure_reason": revision.failure_reason} if to == S.FAILED else {}
    )
    live_event(
        tenant_id=revision.adapter.tenant_id,
        type="revision.state",
        id=revision.id,
        state=to,
        updated_us=epoch_us(now),
        adapter=revision.adapter.name,
        revision=f"r{revision.number}",
        **failure,
    )
    return revision


# ---------------------------------------------------------------- adapters


@transaction.atomic
def adapter_create(*, tenant: Tenant, name: str, base_model: BaseModel, description: str, by: Actor) -> Adapter:
    """Create an adapter, within the tenant's `max_adapters` quota."""
    locked = Tenant.objects.select_for_update().get(id=tenant.id)  # serialises the quota check
    count = Adapter.objects.filter(tenant=locked).count()
    if count >= locked.max_adapters:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} already has {count} adapters, its limit (max_adapters={locked.max_adapters}).",
            code="adapter_quota_exceeded",
        )
    try:
        with transaction.atomic():
            adapter = Adapter.objects.create(
                tenant=tenant,
                name=name,
                base_model=base_model,
                description=description,
                created_by=by.person if by.person is not None and by.person.pk is not None else None,
            )
    except IntegrityError:
        raise Conflict(f"An adapter named {name!r} already exists.", code="adapter_exists") from None
    audit_record(
        tenant=tenant,
        actor=by,
        action="adapter.create",
        target=f"adapter:{name}",
        after={"base_model": base_model.name, "description": description},
    )
    return adapter


# ---------------------------------------------------------------- registration


def _store_uploads(adapter: Adapter, files: Sequence[UploadedFile], *, limit: int) -> tuple[str, int]:
    """Stream uploaded files into a fresh upload prefix. Removes it again on any failure."""
    names = [_clean_upload_name(f.name) for f in files]
    duplicates = sorted(name for name, seen in Counter(names).items() if seen > 1)
    if duplicates:
        raise MintError(f"Files uploaded twice: {', '.join(duplicates)}.", code="duplicate_file")
    prefix = store.new_upload_prefix(adapter)
    total = 0
    try:
        for name, upload in zip(names, files, strict=True):
            total += upload.size or 0
            if total > limit:
                raise PayloadTooLarge(f"The upload exceeds this tenant's limit of {limit} bytes.")
            store.save_file(f"{prefix}/{name}", upload)
            upload.close()  # one uploaded file open at a time, however many there are (mint_site/uploads.py)
    except BaseException:
        store.delete_prefix(prefix)
        raise
    return prefix, total


def _clean_upload_name(name: str) -> str:
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    if not base or base.startswith(".") or "\x00" in base:
        raise MintError(f"Unusable file name {name!r}.", code="bad_file_name")
    return base


def check_storage_quota(tenant: Tenant, *, adding_bytes: int) -> None:
    """Refuse a new revision of `adding_bytes` past the tenant's stored bytes or revisions (429).

    Exact when `tenant` was just read under its row lock; a fresh read is a good early check.
    """
    use = selectors.storage_use(tenant=tenant)
    detail = {
        "max_storage_bytes": tenant.max_storage_bytes,
        "stored_bytes": use.bytes,
        "max_revisions": tenant.max_revisions,
        "stored_revisions": use.revisions,
    }
    collected = (
        f"failed and rejected revisions are collected {settings.MINT_UPLOAD_RETENTION_DAYS:g} days after they end"
    )
    if use.revisions + 1 > tenant.max_revisions:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} keeps {use.revisions} revisions, its limit (max_revisions={tenant.max_revisions}); "
            f"{collected}, or ask for a larger plan.",
            code="storage_quota_exceeded",
            detail=detail,
        )
    if use.bytes + adding_bytes > tenant.max_storage_bytes:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} stores {use.bytes} bytes of adapters; {adding_bytes} more would pass its limit "
            f"(max_storage_bytes={tenant.max_storage_bytes}); {collected}, or ask for a larger plan.",
            code="storage_quota_exceeded",
            detail=detail,
        )


def _source_from_uri(tenant: Tenant, uri: str) -> tuple[str, int]:
    """Check a `source_uri` points into the tenant's own incoming area and exists."""
    raw = uri.removeprefix("store://").removeprefix("/")
    path = store.clean_relative_path(raw.rstrip("/"))
    incoming = store.incoming_prefix(tenant.id)
    if path is None or not path.startswith(incoming + "/"):
        raise MintError(
            f"source_uri must name a file or folder under {incoming}/ in the artifact store.",
            code="bad_source_uri",
            detail={"source_uri": uri},
        )
    files = [path] if store.exists(path) and not store.list_files(path) else store.list_files(path)
    if not files or not all(store.exists(f) for f in files[:1]):
        raise MintError(f"Nothing found at source_uri {uri!r}.", code="source_not_found", detail={"source_uri": uri})
    storage = store.artifact_storage()
    return path, sum(storage.size(f) for f in files)


def revision_register(
    *,
    adapter: Adapter,
    by: Actor,
    files: Sequence[UploadedFile] = (),
    source_uri: str | None = None,
    training_step: int | None = None,
    parent_number: int | None = None,
) -> AdapterRevision:
    """Record a new revision (`registered`, next number) and queue its validation.

    Files are streamed into the store first, outside any transaction; the revision row
    and its number are created after, under a short lock on the adapter row. If anything
    fails after the files were stored, they are removed: no orphan files, no partial rows.
    """
    if bool(files) == bool(source_uri):
        raise MintError(
            "Send either files (multipart `files` or one `archive`) or a `source_uri`, not both.",
            code="no_artifact" if not files and not source_uri else "ambiguous_artifact",
        )
    tenant = adapter.tenant
    if parent_number is not None and not AdapterRevision.objects.filter(adapter=adapter, number=parent_number).exists():
        raise MintError(
            f"parent: {adapter.name} has no r{parent_number}.",
            code="invalid_request",
            detail={"parent": [f"no revision r{parent_number}"]},
        )
    owned_prefix = None
    if files:
        check_storage_quota(tenant, adding_bytes=sum(f.size or 0 for f in files))  # before a byte is stored
        owned_prefix, size = _store_uploads(adapter, files, limit=tenant.max_upload_bytes)
        source = owned_prefix
    else:
        source, size = _source_from_uri(tenant, source_uri)
        if size > tenant.max_upload_bytes:
            raise PayloadTooLarge(
                f"The artifact at source_uri is {size} bytes, over this tenant's limit of {tenant.max_upload_bytes}."
            )
    try:
        with transaction.atomic():
            # The tenant row lock serialises this tenant's registrations, so two cannot both fit the quota.
            check_storage_quota(Tenant.objects.select_for_update().get(id=tenant.id), adding_bytes=size)
            Tenant.objects.filter(id=tenant.id).update(
                stored_bytes=F("stored_bytes") + size, stored_revisions=F("stored_revisions") + 1
            )
            locked = Adapter.objects.select_for_update().get(id=adapter.id)
            locked.revision_counter += 1
            locked.save(update_fields=["revision_counter"])
            parent = (
                AdapterRevision.objects.filter(adapter=adapter, number=parent_number).first()
                if parent_number is not None
                else None
            )
            person = by.person if by.person is not None and by.person.pk is not None else None
            revision = AdapterRevision.objects.create(
                adapter=adapter,
                number=locked.revision_counter,
                source_uri=source,
                size_bytes=size,
                training_step=training_step,
                parent=parent,
                created_by=person,
                created_by_key=by.key,
            )
            revision.adapter = adapter
            audit_record(
                tenant=tenant,
                actor=by,
                action="revision.register",
                target=_target(revision),
                after={"state": S.REGISTERED, "size_bytes": size, "source": source},
            )
            dispatch.dispatch_on_commit()  # validation waits its turn in the fair control queue
    except BaseException:
        if owned_prefix:
            store.delete_prefix(owned_prefix)
        raise
    return revision


def _notify_serving(alias_id: int) -> None:
    """Tell the serving plane an alias wants a new revision. Looked up by name: adapters does not import serving."""
    from importlib import import_module

    from django.apps import apps

    if apps.is_installed("serving"):
        import_module("serving.tasks").alias_converge.delay(alias_id=alias_id)


def _enqueue(task_name: str, revision_id: int) -> None:
    from adapters import tasks  # tasks import services; import late to keep the module graph one-way

    getattr(tasks, task_name).delay(revision_id=revision_id)


# ---------------------------------------------------------------- validation and export (called by tasks)


@transaction.atomic
def revision_mark_validated(
    *,
    revision: AdapterRevision,
    rank: int,
    alpha: float,
    target_modules: list[str],
    sha256: str,
    size_bytes: int,
) -> AdapterRevision:
    _transition(
        revision,
        to=S.VALIDATED,
        sources=[S.REGISTERED],
        by=Actor.system(),
        action="validate",
        extra_after={"rank": rank, "alpha": alpha, "target_modules": target_modules},
        rank=rank,
        alpha=alpha,
        target_modules=target_modules,
        sha256=sha256,
        size_bytes=size_bytes,
        validated_at=timezone.now(),
        deliveries=0,
    )
    transaction.on_commit(lambda: _enqueue("revision_export", revision.id))  # it keeps its place in the queue
    return revision


@transaction.atomic
def revision_fail(*, revision: AdapterRevision, code: str, reason: str) -> AdapterRevision:
    """Mark a revision failed with a reason a person can act on. Only before it is exported."""
    _transition(
        revision,
        to=S.FAILED,
        sources=[S.REGISTERED, S.VALIDATED],
        by=Actor.system(),
        action="fail",
        extra_after={"code": code, "reason": reason},
        failure_code=code,
        failure_reason=reason,
    )
    dispatch.dispatch_on_commit()  # its place in the control queue is free
    return revision


def revision_delivery_start(*, revision: AdapterRevision, stage: str) -> bool:
    """Count one delivery of the current stage's task; False (and the revision failed) once past the bound.

    A delivery that never comes back (its worker was killed: out of memory, a crash, a hard time
    limit) is redelivered by the broker; each one is counted here before any work starts, so a
    task that kills every worker it reaches fails after MINT_TASK_MAX_DELIVERIES instead.
    """
    bound = settings.MINT_TASK_MAX_DELIVERIES
    with transaction.atomic():
        current = AdapterRevision.objects.select_for_update().filter(id=revision.id).first()
        if current is None or current.state != revision.state:
            return False
        if current.deliveries < bound:
            AdapterRevision.objects.filter(id=revision.id).update(deliveries=F("deliveries") + 1)
            revision.deliveries = current.deliveries + 1
            return True
    revision_fail(
        revision=revision,
        code=f"{stage}_resources",
        reason=(
            f"The {stage} of r{revision.number} was started {current.deliveries} times and never finished: "
            "each time the worker running it was lost (killed for memory, crashed or past its time limit). "
            "Check the upload is the adapter's files only; an operator can see the worker logs."
        ),
    )
    return False


def revision_delivery_returned(*, revision: AdapterRevision) -> None:
    """A delivery that ended on purpose without finishing (a retry after a store outage) is not a lost one."""
    AdapterRevision.objects.filter(id=revision.id, deliveries__gt=0).update(deliveries=F("deliveries") - 1)


def revision_mark_exported(*, revision: AdapterRevision, staging: str, policy_record: dict[str, Any]) -> bool:
    """Publish a complete export written under `staging`. Returns False if another run already did.

    Holds the revision row lock while the staging files are promoted, so two runs of the
    same export (a redelivered task) cannot both publish.
    """
    final = store.export_prefix(revision)
    export_bytes = sum(int(f["size_bytes"]) for f in policy_record["files"])
    with transaction.atomic():
        current = AdapterRevision.objects.select_for_update().get(id=revision.id)
        if current.state != S.VALIDATED:
            store.delete_prefix(staging)
            return False
        store.promote(staging, final)
        _transition(
            revision,
            to=S.EXPORTED,
            sources=[S.VALIDATED],
            by=Actor.system(),
            action="export",
            extra_after={"export_uri": final, "files": len(policy_record["files"])},
            export_uri=final,
            policy_record=policy_record,
            exported_at=timezone.now(),
            export_bytes=export_bytes,
            deliveries=0,
        )
        Tenant.objects.filter(id=revision.adapter.tenant_id).update(stored_bytes=F("stored_bytes") + export_bytes)
        dispatch.dispatch_on_commit()  # its place in the control queue is free
    return True


def revision_restore_export(*, revision: AdapterRevision, staging: str) -> None:
    """Put back the export of an already exported revision (for a rollback after its export was removed)."""
    final = store.export_prefix(revision)
    with transaction.atomic():
        AdapterRevision.objects.select_for_update().get(id=revision.id)
        if export_is_complete(revision):
            store.delete_prefix(staging)
            return
        store.promote(staging, final)
        audit_record(
            tenant=revision.adapter.tenant,
            actor=Actor.system(),
            action="revision.reexport",
            target=_target(revision),
            after={"export_uri": final},
        )


def export_is_complete(revision: AdapterRevision) -> bool:
    record = revision.policy_record or {}
    names = [f["name"] for f in record.get("files", [])]
    return bool(revision.export_uri and names) and all(store.exists(f"{revision.export_uri}/{n}") for n in names)


# ---------------------------------------------------------------- approval


@transaction.atomic
def revision_request_approval(*, revision: AdapterRevision, by: Actor) -> AdapterRevision:
    return _transition(revision, to=S.PENDING_APPROVAL, sources=[S.EXPORTED], by=by, action="request_approval")


def _registered_by(revision: AdapterRevision, actor: Actor) -> bool:
    """Whether `actor` is the registrant of `revision`: the same key, or the same person (keys act as their creator).

    A key without a creator is nobody: what it registered was registered by no person, so any person may
    decide it (and such a key never decides under four-eyes: `_decide`).
    """
    if actor.key is not None and revision.created_by_key_id == actor.key.id:
        return True
    registrant = revision.created_by_id
    if registrant is None and revision.created_by_key_id is not None:
        registrant = revision.created_by_key.created_by_id
    person = actor.person
    return registrant is not None and person is not None and person.pk == registrant


def _decide(*, revision: AdapterRevision, by: Actor, decision: str, comment: str) -> AdapterRevision:
    if revision.adapter.tenant.four_eyes and by.key is not None and by.key.created_by_id is None:
        # Four-eyes counts people. Two ownerless keys are not two people (one operator may hold both), so a
        # key that stands for nobody cannot be the second pair of eyes.
        raise Forbidden(
            f"Four-eyes: key mint_{by.key.prefix}… has no owner, and a key without an owner cannot approve or "
            "reject under four-eyes; ask for a key created by a person (an approver or owner).",
            code="four_eyes",
        )
    if revision.adapter.tenant.four_eyes and _registered_by(revision, by):
        raise Forbidden(
            f"Four-eyes: r{revision.number} was registered by {by.person or by.label}; someone else must decide.",
            code="four_eyes",
        )
    to = S.APPROVED if decision == Approval.Decision.APPROVED else S.REJECTED
    _transition(
        revision,
        to=to,
        sources=[S.PENDING_APPROVAL],
        by=by,
        action="approve" if to == S.APPROVED else "reject",
        extra_after={"comment": comment},
        decided_at=timezone.now(),
    )
    person = by.person if by.person is not None and by.person.pk is not None else None
    Approval.objects.create(
        revision=revision, decided_by=person, decided_by_key=by.key, decision=decision, comment=comment
    )
    return revision


@transaction.atomic
def revision_approve(*, revision: AdapterRevision, by: Actor, comment: str = "") -> AdapterRevision:
    """Approve a pending revision. Four-eyes: the registrant (or a key they created) cannot approve."""
    return _decide(revision=revision, by=by, decision=Approval.Decision.APPROVED, comment=comment)


@transaction.atomic
def revision_reject(*, revision: AdapterRevision, by: Actor, comment: str = "") -> AdapterRevision:
    return _decide(revision=revision, by=by, decision=Approval.Decision.REJECTED, comment=comment)


# ---------------------------------------------------------------- activation, flip, rollback


def _locked_alias(adapter: Adapter, name: str, *, create: bool) -> Alias:
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
    return alias


def _label(revision: AdapterRevision | None) -> str | None:
    return f"r{revision.number}" if revision is not None else None


def _set_desired(target: Alias, revision: AdapterRevision, *, rollback: bool, by: Actor) -> None:
    """Point a locked alias's desired revision at `revision`, and audit it as an activation or a rollback."""
    before = {"revision": _label(target.revision), "desired": _label(target.desired_revision)}
    target.desired_revision = revision
    target.rollback_pending = rollback
    target.updated_by = by.label
    target.updated_at = timezone.now()
    target.save(update_fields=["desired_revision", "rollback_pending", "updated_by", "updated_at"])
    audit_record(
        tenant=target.adapter.tenant,
        actor=by,
        action="alias.rollback" if rollback else "alias.activate",
        target=f"alias:{target.adapter.name}:{target.name}",
        before=before,
        after={"revision": _label(target.revision), "desired": _label(revision)},
    )


@transaction.atomic
def revision_activate(
    *, adapter: Adapter, revision: AdapterRevision, by: Actor, alias: str = Alias.PRODUCTION
) -> Alias:
    """Make `revision` the desired target of `alias`. The alias flips when the serving plane has it ready."""
    if revision.state != S.APPROVED:
        raise InvalidTransition(
            f"r{revision.number} is {revision.state}; only approved revisions can be activated.",
            detail={"state": revision.state},
        )
    target = _locked_alias(adapter, alias, create=True)
    _set_desired(target, revision, rollback=False, by=by)
    transaction.on_commit(lambda: _notify_serving(target.id))
    return target


@transaction.atomic
def revision_rollback(
    *, adapter: Adapter, by: Actor, alias: str = Alias.PRODUCTION, revision: AdapterRevision | None = None
) -> Alias:
    """Point `alias` back at the revision live before the current one (or at `revision`), as a rollback.

    Nothing is retrained: the target's frozen export is served again, re-exported from its
    source first if the export was removed.
    """
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
    if goal.state != S.APPROVED:
        raise InvalidTransition(
            f"r{goal.number} is {goal.state}; rollback needs an approved revision.", detail={"state": goal.state}
        )
    _set_desired(target, goal, rollback=True, by=by)
    if not export_is_complete(goal):
        transaction.on_commit(lambda: _enqueue("revision_export", goal.id))
    transaction.on_commit(lambda: _notify_serving(target.id))
    return target


@transaction.atomic
def alias_flip(
    *, adapter: Adapter, revision: AdapterRevision, alias: str = Alias.PRODUCTION, by: Actor | None = None
) -> Alias:
    """Point `alias` at its desired `revision`, atomically. Called by the serving plane once it is ready."""
    target = _locked_alias(adapter, alias, create=False)
    if target.desired_revision_id != revision.id:
        raise InvalidTransition(
            f"{adapter.name}:{alias} wants {_label(target.desired_revision)}, not r{revision.number}.",
            code="not_desired",
        )
    if target.revision_id == revision.id:
        return target
    before = {"revision": _label(target.revision)}
    target.previous_revision = target.revision
    target.revision = revision
    target.rollback_pending = False
    target.updated_at = timezone.now()
    target.save(update_fields=["previous_revision", "revision", "rollback_pending", "updated_at"])
    audit_record(
        tenant=adapter.tenant,
        actor=by or Actor.system(),
        action="alias.flip",
        target=f"alias:{adapter.name}:{alias}",
        before=before,
        after={"revision": _label(revision)},
    )
    live_event(
        tenant_id=adapter.tenant_id,
        type="alias.flip",
        id=target.id,
        state="live",
        adapter=adapter.name,
        alias=alias,
        revision=_label(revision),
    )
    return target
