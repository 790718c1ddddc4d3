"""Creating adapters (and setting their replica override) and registering revisions: uploads into the store,
storage quotas, the fair queue.

Registration is the fast, synchronous step: the files are stored, the row is created `registered`
and the revision joins the tenant's place in the control queue (adapters.dispatch).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction
from django.db.models import F

from adapters import dispatch, runs, selectors, signals, store
from adapters.artifacts.archive import ArchiveLimits
from adapters.artifacts.digest import combined_digest, sha256_stream
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.precheck import Upload, precheck_upload
from adapters.models import Adapter, AdapterRevision, BaseModel
from adapters.models import RevisionState as S
from adapters.services.transitions import revision_fail
from adapters.states import audit_target
from mint_site.errors import Conflict, MintError, PayloadTooLarge, QuotaExceeded
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)


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
        deleted = Adapter.all_objects.filter(tenant=tenant, name=name, deleted_at__isnull=False).first()
        if deleted is not None:  # names are not reused: usage, audit events and model strings name adapters by them
            raise Conflict(
                f"An adapter named {name!r} was deleted on {deleted.deleted_at:%Y-%m-%d}; a deleted adapter's name "
                "is not given to a new one. Choose another name.",
                code="adapter_name_retired",
            ) from None
        raise Conflict(f"An adapter named {name!r} already exists.", code="adapter_exists") from None
    audit_record(
        tenant=tenant,
        actor=by,
        action="adapter.create",
        target=f"adapter:{name}",
        after={"base_model": base_model.name, "description": description},
    )
    return adapter


REPLICAS_ABOVE_PLAN = "replicas_above_plan"


@transaction.atomic
def adapter_set_replicas(*, adapter: Adapter, replicas: int | None, by: Actor) -> Adapter:
    """Set the adapter's replica override (None: the platform default, MINT_ALIAS_READY_REPLICAS), at most its
    tenant's `max_replicas` (429 `replicas_above_plan`), audited `adapter.replicas` when it changes.

    Only the catalog row: the serving plane converges on it (serving.services.aliases.adapter_scale calls this).
    Returns the adapter, locked and saved, with its tenant as read under the lock.
    """
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise MintError("replicas: a whole number of at least 1, or null for the default.", code="invalid_request")
    locked = Adapter.objects.select_for_update(of=("self",)).select_related("tenant", "base_model").get(id=adapter.id)
    limit = locked.tenant.max_replicas
    if replicas is not None and replicas > limit:
        raise QuotaExceeded(
            f"replicas: {replicas} is above the {limit} replicas tenant {locked.tenant.slug}'s plan allows an "
            "adapter (plan field max_replicas). Ask for a larger plan, or use fewer.",
            code=REPLICAS_ABOVE_PLAN,
            detail={"quota": "max_replicas", "limit": limit, "requested": replicas},
        )
    if locked.replicas != replicas:
        before = locked.replicas
        locked.replicas = replicas
        locked.save(update_fields=["replicas"])
        audit_record(
            tenant=locked.tenant,
            actor=by,
            action="adapter.replicas",
            target=f"adapter:{locked.name}",
            before={"replicas": before},
            after={"replicas": replicas, "count": locked.replica_count},
        )
    return locked


# ---------------------------------------------------------------- registration


class DuplicateRevision(Conflict):
    """409 `duplicate_revision`: the upload equals a revision the adapter already has (the same source digest).

    `original` is that revision; `detail` names it (`{"duplicate_of": "r3", …}`). The dashboard shows `message`.
    """

    code = "duplicate_revision"

    def __init__(self, *, original: AdapterRevision, adapter: Adapter, sha256: str):
        super().__init__(
            f"This upload is identical to {original.label} of {adapter.name} ({original.state}): the same files with "
            f"the same contents (sha256 {sha256[:12]}…). Nothing was registered; send allow_duplicate=true to "
            "register it again anyway.",
            detail={"duplicate_of": original.label, "state": original.state, "sha256": sha256},
        )
        self.original = original


class IncompleteUpload(MintError):
    """400: the upload cannot be an adapter, seen from its names, its config or a zip's directory (nothing stored).

    `code` is validation's own for the problem (`missing_adapter_config`, `no_tensors`, `bad_adapter_config`,
    `pickle_forbidden`, `bad_archive`, `rank_too_high`, …); `detail` lists the uploaded file names.
    """


def _upload_names(files: Sequence[UploadedFile]) -> list[str]:
    names = [_clean_upload_name(f.name) for f in files]
    duplicates = sorted(name for name, seen in Counter(names).items() if seen > 1)
    if duplicates:
        raise MintError(f"Files uploaded twice: {', '.join(duplicates)}.", code="duplicate_file")
    return names


def _archive_limits() -> ArchiveLimits:
    return ArchiveLimits(
        max_files=settings.MINT_ARCHIVE_MAX_FILES,
        max_zip_directory_bytes=settings.MINT_ARCHIVE_MAX_ZIP_DIRECTORY_BYTES,
    )


def _precheck(adapter: Adapter, names: list[str], files: Sequence[UploadedFile], *, sent_as_archive: bool) -> None:
    """Refuse an upload that obviously is no adapter (IncompleteUpload, 400) before anything is stored."""
    uploads = [Upload(name=n, stream=f, size=f.size or 0) for n, f in zip(names, files, strict=True)]
    try:
        precheck_upload(
            uploads,
            sent_as_archive=sent_as_archive,
            limits=_archive_limits(),
            max_lora_rank=adapter.base_model.max_lora_rank,
        )
    except ArtifactError as exc:
        raise IncompleteUpload(exc.message, code=exc.code, detail={"files": names[:20]}) from None


def uploads_digest(names: Sequence[str], files: Sequence[UploadedFile]) -> str:
    """The source digest (adapters/artifacts/digest.py) of files about to be stored flat under `names`.

    Each file's SHA-256 is the one taken while the body streamed in (`sha256`, set by
    adapters.apis.DigestUploadHandler); a file without one (the dashboard's, a test's) is read once here.
    """
    per_file = []
    for name, upload in zip(names, files, strict=True):
        digest = getattr(upload, "sha256", None)
        if digest is None and hasattr(upload, "temporary_file_path"):
            with open(upload.temporary_file_path(), "rb") as handle:  # no descriptor left open per file
                digest = sha256_stream(handle)
        elif digest is None:
            upload.seek(0)
            digest = sha256_stream(upload)
            upload.seek(0)
        per_file.append((name, digest))
    return combined_digest(per_file)


def _live_duplicate(adapter_id: int, sha256: str, *, exclude_id: int | None = None) -> AdapterRevision | None:
    """The adapter's first revision with this source digest that has not failed (failed ones may be re-sent)."""
    found = AdapterRevision.objects.filter(adapter_id=adapter_id, sha256=sha256).exclude(state=S.FAILED)
    if exclude_id is not None:
        found = found.exclude(id=exclude_id)
    return found.order_by("number").first()


def _store_uploads(
    adapter: Adapter, files: Sequence[UploadedFile], names: Sequence[str], *, limit: int
) -> tuple[str, int]:
    """Stream uploaded files into a fresh upload prefix. Removes it again on any failure."""
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


def _check_quota_making_room(tenant: Tenant, *, adding_bytes: int) -> None:
    """`check_storage_quota`, and when the quota is full, a second look once retention (serving, through
    `signals.storage_needed`) archived what its policies let go: a pipeline pushing with retention on is not
    refused for revisions its retention would archive minutes later."""
    try:
        check_storage_quota(tenant, adding_bytes=adding_bytes)
    except QuotaExceeded:
        signals.storage_needed.send(sender=Tenant, tenant_id=tenant.id)
        check_storage_quota(Tenant.objects.get(id=tenant.id), adding_bytes=adding_bytes)


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
    archive: UploadedFile | None = None,
    source_uri: str | None = None,
    training_step: int | None = None,
    parent_number: int | None = None,
    allow_duplicate: bool = False,
    run: str = "",
    metrics: dict | None = None,
    prewarm: bool = False,
) -> AdapterRevision:
    """Record a new revision (`registered`, next number) and queue its validation.

    `run` and `metrics` record the training run it belongs to and what the trainer measured at its step
    (adapters/runs.py bounds them); `prewarm` has it placed on a node as soon as it is exported, to be sampled.

    Send `files` (the adapter's files; a single archive among them is unpacked too), one `archive`, or a
    `source_uri`. Before anything is stored, an upload that obviously is no adapter is refused
    (`IncompleteUpload`, 400) and one equal to a revision the adapter has that did not fail is refused
    (`DuplicateRevision`, 409) unless `allow_duplicate`; a `source_uri` is compared when validation
    digests it. Refusals spend no revision number.

    Files are streamed into the store first, outside any transaction; the revision row
    and its number are created after, under a short lock on the adapter row. If anything
    fails after the files were stored, they are removed: no orphan files, no partial rows.
    """
    if files and archive is not None:
        raise MintError(
            f"Send either files ({', '.join(f.name for f in files[:5])}{', …' if len(files) > 5 else ''}) or one "
            f"archive ({archive.name}), not both: the archive would be ignored.",
            code="ambiguous_artifact",
            detail={"files": [f.name for f in files[:20]], "archive": archive.name},
        )
    sent_as_archive = archive is not None
    if archive is not None:
        files = [archive]
    if bool(files) == bool(source_uri):
        raise MintError(
            "Send either files (multipart `files` or one `archive`) or a `source_uri`, not both.",
            code="no_artifact" if not files and not source_uri else "ambiguous_artifact",
        )
    tenant = adapter.tenant
    run, metrics = runs.clean_run(run), runs.clean_metrics(metrics)
    if parent_number is not None and not AdapterRevision.objects.filter(adapter=adapter, number=parent_number).exists():
        raise MintError(
            f"parent: {adapter.name} has no r{parent_number}.",
            code="invalid_request",
            detail={"parent": [f"no revision r{parent_number}"]},
        )
    owned_prefix = None
    digest = ""
    if files:
        names = _upload_names(files)
        _precheck(adapter, names, files, sent_as_archive=sent_as_archive)
        digest = uploads_digest(names, files)
        if not allow_duplicate and (original := _live_duplicate(adapter.id, digest)) is not None:
            raise DuplicateRevision(original=original, adapter=adapter, sha256=digest)  # before a byte is stored
        _check_quota_making_room(tenant, adding_bytes=sum(f.size or 0 for f in files))  # before a byte is stored
        owned_prefix, size = _store_uploads(adapter, files, names, limit=tenant.max_upload_bytes)
        source = owned_prefix
    else:
        source, size = _source_from_uri(tenant, source_uri)
        if size > tenant.max_upload_bytes:
            raise PayloadTooLarge(
                f"The artifact at source_uri is {size} bytes, over this tenant's limit of {tenant.max_upload_bytes}."
            )
        _check_quota_making_room(tenant, adding_bytes=size)
    try:
        with transaction.atomic():
            # The tenant row lock serialises this tenant's registrations, so two cannot both fit the quota.
            check_storage_quota(Tenant.objects.select_for_update().get(id=tenant.id), adding_bytes=size)
            Tenant.objects.filter(id=tenant.id).update(
                stored_bytes=F("stored_bytes") + size, stored_revisions=F("stored_revisions") + 1
            )
            locked = Adapter.objects.select_for_update().get(id=adapter.id)
            # Again under the adapter's lock: of two equal uploads racing, the second finds the first.
            if digest and not allow_duplicate and (original := _live_duplicate(adapter.id, digest)) is not None:
                raise DuplicateRevision(original=original, adapter=adapter, sha256=digest)
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
                sha256=digest,
                allow_duplicate=allow_duplicate,
                size_bytes=size,
                training_step=training_step,
                parent=parent,
                run=run,
                metrics=metrics,
                prewarm=prewarm,
                created_by=person,
                created_by_key=by.key,
            )
            revision.adapter = adapter
            audit_record(
                tenant=tenant,
                actor=by,
                action="revision.register",
                target=audit_target(revision),
                after={
                    "state": S.REGISTERED,
                    "size_bytes": size,
                    "source": source,
                    **({"allow_duplicate": True} if allow_duplicate else {}),  # a deliberate repeat, on record
                    **({"run": run} if run else {}),
                },
            )
            dispatch.dispatch_on_commit()  # validation waits its turn in the fair control queue
    except BaseException:
        if owned_prefix:
            store.delete_prefix(owned_prefix)
        raise
    return revision


@transaction.atomic
def revision_fail_if_duplicate(*, revision: AdapterRevision, sha256: str) -> AdapterRevision | None:
    """For a source digested only by validation (a `source_uri`): the duplicate check registration could not make.

    If another revision of the adapter that has not failed has the same digest, `revision` fails with
    `duplicate_revision` and `duplicate_of` set to that revision's number, which is returned. Otherwise the
    digest is recorded on `revision` at once (so a later equal source finds it) and None is returned.
    Takes the adapter's row lock, as registration does: of two equal sources, exactly one passes.
    """
    list(Adapter.objects.select_for_update().filter(id=revision.adapter_id).values_list("id", flat=True))
    original = _live_duplicate(revision.adapter_id, sha256, exclude_id=revision.id)
    if original is None:
        AdapterRevision.objects.filter(id=revision.id, state=S.REGISTERED).update(sha256=sha256)
        return None
    AdapterRevision.objects.filter(id=revision.id).update(duplicate_of=original.number)
    revision.duplicate_of = original.number
    revision_fail(
        revision=revision,
        code="duplicate_revision",
        reason=(
            f"The source is identical to {original.label} ({original.state}): the same files with the same contents "
            f"(sha256 {sha256[:12]}…). Register it with allow_duplicate=true to keep both."
        ),
    )
    return original
