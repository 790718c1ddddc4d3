"""Resumable uploads: one archive sent as numbered parts, then registered as a revision like a one-shot upload.

A session declares the whole file first (`size`, `sha256`, `filename`), so the tenant's upload limit, its
storage quota (open sessions' declared sizes count against it) and its open-session limit refuse it before a
byte is stored. Parts 1..n of MINT_UPLOAD_PART_BYTES (the last one shorter) arrive in any order, each checked
against its own SHA-256 and its exact expected length before it is stored; a part already received is accepted
again only with the same digest.

Where the parts go depends on the artifact store (adapters/upload_parts.py: files, or one S3 multipart upload
started with the session). A failed S3 call is a 503 `s3_store_unavailable` that leaves the session as it was (a
part not recorded, a session not opened), so the client sends the same request again.

Either way registration needs the whole file on local disk, to precheck and digest it before it is stored once
more as the revision's source: `complete` checks the whole file's digest and hands that file to
`revision_register` as the one-shot upload's `archive`: precheck, duplicate check, quota, store, validation and
export are exactly those of a one-shot upload. Abandoned sessions are collected with their parts (and their
multipart upload aborted) once past `expires_at` (beat: `upload_sessions_collect`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone

from adapters import store, upload_gate, upload_parts
from adapters.models import Adapter, AdapterRevision, UploadPart, UploadSession, UploadState
from adapters.services import registration
from mint_site.errors import Conflict, MintError, NotFound, PayloadTooLarge, QuotaExceeded
from mint_site.limits import Allowance, Refusal, RouteLimit
from mint_site.uploads import ClosedUploadedFile
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1024 * 1024
# A `complete` that claimed a session and then died (its process killed) leaves the claim behind; after this
# long another `complete` may take it over. Longer than assembling and storing the largest upload takes.
COMPLETE_CLAIM_S = 3600
COLLECT_BATCH = 200


def _part_allowance() -> Allowance:
    limit = settings.MINT_UPLOAD_PART_BYTES
    return Allowance(
        limit,
        Refusal(
            400,
            "part_size_mismatch",
            f"A part is at most part_size ({limit} bytes, MINT_UPLOAD_PART_BYTES); this body is longer.",
        ),
    )


# The ASGI body limit of the part route (mint_site/asgi.py): a part's body, refused past part_size before Django
# reads it, instead of the MINT_MAX_REQUEST_BYTES every other non-upload route has, and only once the caller
# is known to be one who may register (a part with a bad key is 401 unread, whatever its length).
PART_ROUTE_LIMIT = RouteLimit(
    method="PUT",
    path=re.compile(r"^/api/v1/adapters/[^/]+/uploads/[^/]+/parts/[0-9]+/$"),
    allowance=_part_allowance,
    gate=upload_gate.part_allowance,
)


# ---------------------------------------------------------------- reads


def upload_sessions_open(*, adapter: Adapter, now=None) -> QuerySet[UploadSession]:
    """The adapter's open sessions that have not expired, newest first (the list the client resumes from)."""
    now = now or timezone.now()
    return (
        UploadSession.objects.filter(adapter=adapter, state=UploadState.OPEN, expires_at__gt=now)
        .select_related("adapter")
        .prefetch_related("parts")
    )


def upload_session_get(*, adapter: Adapter, session_id: str) -> UploadSession:
    """The adapter's session `session_id`, or NotFound: the same for a malformed id, another tenant's or
    adapter's session, and one that expired (it is as good as collected)."""
    try:
        wanted = uuid.UUID(str(session_id))
    except ValueError:
        raise NotFound("Not found.") from None
    session = (
        UploadSession.objects.filter(id=wanted, adapter=adapter, tenant_id=adapter.tenant_id)
        .prefetch_related("parts")
        .first()
    )
    if session is None or (session.state == UploadState.OPEN and session.expires_at <= timezone.now()):
        raise NotFound("Not found.")
    session.adapter = adapter  # the caller's, with its tenant and base model (registration reads both)
    return session


def received_parts(session: UploadSession) -> list[int]:
    return sorted(part.number for part in session.parts.all())


def _open_sessions_of(tenant_id: int, now) -> QuerySet[UploadSession]:
    return UploadSession.objects.filter(tenant_id=tenant_id, state=UploadState.OPEN, expires_at__gt=now)


# ---------------------------------------------------------------- create


def _check_declaration(*, tenant: Tenant, size: int, sha256: str, filename: str) -> tuple[str, str]:
    """The declared file, or the 4xx naming what is wrong with it. Returns the normalised digest and name."""
    if size < 1:
        raise MintError(
            "size: the upload is empty (0 bytes); declare the archive's size in bytes.", code="empty_upload"
        )
    if size > tenant.max_upload_bytes:
        raise PayloadTooLarge(
            f"The upload ({size} bytes) is over this tenant's limit of {tenant.max_upload_bytes} bytes.",
            detail={"size": size, "max_upload_bytes": tenant.max_upload_bytes},
        )
    digest = sha256.strip().lower()
    if not upload_parts.SHA256_HEX.match(digest):
        raise MintError(
            "sha256: give the whole file's SHA-256 as 64 hexadecimal digits.",
            code="bad_sha256",
            detail={"sha256": sha256[:100]},
        )
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    if not name or name.startswith(".") or "\x00" in name or not name.lower().endswith(ARCHIVE_SUFFIXES):
        raise MintError(
            f"filename: {filename[:100]!r} is not an archive; send one .tar, .tar.gz, .tgz or .zip.",
            code="bad_filename",
            detail={"filename": filename[:100], "accepted": list(ARCHIVE_SUFFIXES)},
        )
    return digest, name


def upload_session_create(*, adapter: Adapter, by: Actor, size: int, sha256: str, filename: str) -> UploadSession:
    """Open a session for one archive of `size` bytes: refused before anything is stored if it could never fit.

    Under the tenant's row lock (as registration takes it), so that two sessions opened at once cannot both
    pass the open-session limit or the quota, to which open sessions' declared sizes count.
    """
    tenant = adapter.tenant
    digest, name = _check_declaration(tenant=tenant, size=size, sha256=sha256, filename=filename)
    session_id = uuid.uuid4()
    # On S3 the multipart upload is started first, outside the tenant lock: a session row always has its
    # upload. A refused (or failed) session aborts the upload it started.
    bucket = store.s3_bucket()
    upload_id = store.multipart_start(bucket, upload_parts.whole_path_for(tenant.id, session_id)) if bucket else ""
    try:
        session = _session_insert(
            adapter=adapter, by=by, session_id=session_id, upload_id=upload_id, declared=(size, digest, name)
        )
    except BaseException:
        if bucket is not None:
            upload_parts.abort_quietly(bucket, upload_parts.whole_path_for(tenant.id, session_id), upload_id)
        raise
    session.adapter = adapter
    return session


def _session_insert(
    *, adapter: Adapter, by: Actor, session_id: uuid.UUID, upload_id: str, declared: tuple[int, str, str]
) -> UploadSession:
    """The session row, inserted under the tenant's lock after the open-session limit and the quota."""
    tenant = adapter.tenant
    size, digest, name = declared
    part_size = settings.MINT_UPLOAD_PART_BYTES
    now = timezone.now()
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().get(id=tenant.id)
        open_sessions = _open_sessions_of(tenant.id, now)
        count = open_sessions.count()
        limit = settings.MINT_UPLOAD_MAX_OPEN_SESSIONS
        if count >= limit:
            raise QuotaExceeded(
                f"Tenant {tenant.slug} has {count} open upload sessions, the most it may have "
                f"(MINT_UPLOAD_MAX_OPEN_SESSIONS={limit}); complete or delete one, or wait for it to expire.",
                code="upload_sessions_exceeded",
                detail={"open_sessions": count, "limit": limit},
            )
        reserved = open_sessions.aggregate(total=Sum("size"))["total"] or 0
        registration.check_storage_quota(locked, adding_bytes=reserved + size)
        person = by.person if by.person is not None and by.person.pk is not None else None
        session = UploadSession.objects.create(
            id=session_id,
            s3_upload_id=upload_id,
            tenant=tenant,
            adapter=adapter,
            created_by=person,
            created_by_key=by.key,
            size=size,
            sha256=digest,
            filename=name,
            part_size=part_size,
            expires_at=now + timedelta(seconds=settings.MINT_UPLOAD_SESSION_TTL_S),
            created_at=now,
        )
        audit_record(
            tenant=tenant,
            actor=by,
            action="upload.create",
            target=f"upload:{adapter.name}/{session.id}",
            after={"size": size, "sha256": digest, "filename": name, "parts": session.part_count},
        )
    return session


# ---------------------------------------------------------------- complete and abort


def _unclaimed(now) -> Q:
    """Sessions no `complete` is at: never claimed, or claimed longer than COMPLETE_CLAIM_S ago (its claimer died)."""
    return Q(completing_since__isnull=True) | Q(completing_since__lt=now - timedelta(seconds=COMPLETE_CLAIM_S))


def _claim(session: UploadSession) -> None:
    """Mark the session as being completed (a conditional update on its row), or 409 if another is at it."""
    now = timezone.now()
    if UploadSession.objects.filter(Q(id=session.id, state=UploadState.OPEN) & _unclaimed(now)).update(
        completing_since=now
    ):
        return
    current = UploadSession.objects.filter(id=session.id).first()
    if current is None:
        raise NotFound("Not found.")
    if current.state != UploadState.OPEN:
        raise upload_parts.not_open(current)
    raise Conflict(
        f"Upload session {session.id} is being completed by another request; GET it to see when it is done.",
        code="upload_completing",
    )


def _release(session: UploadSession) -> None:
    UploadSession.objects.filter(id=session.id, state=UploadState.OPEN).update(completing_since=None)


def upload_session_complete(
    *,
    session: UploadSession,
    by: Actor,
    training_step: int | None = None,
    parent_number: int | None = None,
    allow_duplicate: bool = False,
    run: str = "",
    metrics: dict | None = None,
    prewarm: bool = False,
) -> AdapterRevision:
    """Assemble an open session's parts and register the file as a revision (revision_register's `archive`).

    409 `upload_incomplete` (`detail.missing`) before every part is in. If the assembled file's SHA-256 is not
    the declared one, 400 `upload_checksum_mismatch`: the parts are dropped and the session stays open, so they
    can be sent again. Registration's own refusals (not an adapter, a duplicate, the quota) leave the session
    open with its parts, so it can be completed again (e.g. with allow_duplicate). On success the session is
    `completed` and its parts are removed.
    """
    if session.state != UploadState.OPEN:
        raise upload_parts.not_open(session)
    _claim(session)
    try:
        parts = list(UploadPart.objects.filter(session_id=session.id).order_by("number"))
        missing = sorted(set(range(1, session.part_count + 1)) - {p.number for p in parts})
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (", …" if len(missing) > 20 else "")
            raise upload_parts.UploadIncomplete(
                f"Upload session {session.id} misses {len(missing)} of its {session.part_count} parts ({shown}); "
                "send them, then complete it.",
                detail={"missing": missing[:1000], "parts": session.part_count},
            )
        path, digest = upload_parts.assemble(session, parts)
        try:
            if digest != session.sha256:
                upload_parts.drop_received(session)
                raise MintError(
                    f"The assembled file has sha256 {digest}, not the declared {session.sha256}. Its parts were "
                    "dropped: send every part again (or, if the declared digest was wrong, open a new session).",
                    code="upload_checksum_mismatch",
                    detail={"expected": session.sha256, "actual": digest, "received": []},
                )
            archive = ClosedUploadedFile(path, session.filename, "application/octet-stream", session.size, None)
            archive.sha256 = digest  # what registration's source digest is built from (no second read)
            revision = registration.revision_register(
                adapter=session.adapter,
                by=by,
                archive=archive,
                training_step=training_step,
                parent_number=parent_number,
                allow_duplicate=allow_duplicate,
                run=run,
                metrics=metrics,
                prewarm=prewarm,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a filesystem store moved it; any other store copied it
    except BaseException:
        _release(session)
        raise
    with transaction.atomic():
        UploadSession.objects.filter(id=session.id).update(
            state=UploadState.COMPLETED, completing_since=None, revision=revision
        )
        audit_record(
            tenant=session.adapter.tenant,
            actor=by,
            action="upload.complete",
            target=f"upload:{session.adapter.name}/{session.id}",
            after={"revision": revision.label, "size": session.size},
        )
    try:
        upload_parts.delete_parts(session)
    except store.S3Unavailable:  # the revision is registered: the collector removes what is left later
        log.warning("could not remove the parts of completed upload session %s", session.id, exc_info=True)
    return revision


def upload_session_abort(*, session: UploadSession, by: Actor) -> None:
    """Abort a session and remove its parts. An aborted or completed one is left as it is (its parts are gone);
    one being completed right now is 409 `upload_completing`."""
    with transaction.atomic():
        aborted = UploadSession.objects.filter(
            Q(id=session.id, state=UploadState.OPEN) & _unclaimed(timezone.now())
        ).update(state=UploadState.ABORTED, completing_since=None)
        if not aborted and UploadSession.objects.filter(id=session.id, state=UploadState.OPEN).exists():
            raise Conflict(
                f"Upload session {session.id} is being completed; it cannot be deleted now.", code="upload_completing"
            )
        if aborted:
            audit_record(
                tenant=session.adapter.tenant,
                actor=by,
                action="upload.abort",
                target=f"upload:{session.adapter.name}/{session.id}",
                before={"state": UploadState.OPEN},
                after={"state": UploadState.ABORTED},
            )
    upload_parts.delete_parts(session)


# ---------------------------------------------------------------- garbage collection


def upload_sessions_collect(*, now=None, batch: int = COLLECT_BATCH) -> int:
    """Delete sessions past their expiry (open, completed or aborted) with their stored parts; returns how many.

    An open one that is being completed is left until its claim is stale: its file may be being registered.
    """
    now = now or timezone.now()
    due = list(UploadSession.objects.filter(Q(expires_at__lte=now) & _unclaimed(now)).order_by("expires_at")[:batch])
    collected = 0
    bucket = store.s3_bucket()
    for session in due:
        # An S3 session's multipart upload is aborted first, and the row kept if that fails (the next run tries
        # again): once the row is gone nothing names the upload. An expired session takes no parts (it is 404).
        if session.s3_upload_id and bucket is not None:
            try:
                store.multipart_abort(bucket, upload_parts.whole_path(session), session.s3_upload_id)
            except store.S3Unavailable:
                log.warning("could not abort the multipart upload of upload session %s", session.id, exc_info=True)
                continue
        # The row goes first (its part rows cascade), and only if no part pushed its expiry back meanwhile; a part
        # stored while it went finds no session to record it in and removes its own file.
        deleted, _ = UploadSession.objects.filter(id=session.id, expires_at__lte=now).delete()
        if deleted:
            try:
                with store.s3_errors("remove an expired upload's stored parts"):
                    store.delete_prefix(upload_parts.session_prefix(session))
            except store.S3Unavailable:
                log.warning("could not remove the stored parts of upload session %s", session.id, exc_info=True)
            collected += 1
    if collected:
        log.info("collected %d expired upload sessions", collected)
    return collected
