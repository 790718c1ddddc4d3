"""Resumable uploads: one archive sent as numbered parts, then registered as a revision like a one-shot upload.

A session declares the whole file first (`size`, `sha256`, `filename`), so the tenant's upload limit, its
storage quota (open sessions' declared sizes count against it) and its open-session limit refuse it before a
byte is stored. Parts 1..n of MINT_UPLOAD_PART_BYTES (the last one shorter) arrive in any order, each checked
against its own SHA-256 and its exact expected length before it is stored; a part already received is accepted
again only with the same digest.

Where the parts go depends on the artifact store:
- a filesystem store keeps each part as a file under `t/<tenant_id>/uploads/<session>/`; `complete` concatenates
  them, in order, into one temporary file;
- the S3 store sends them to one S3 multipart upload of the object `t/<tenant_id>/uploads/<session>/whole`,
  started with the session (its UploadId in `s3_upload_id`, each part's ETag in `s3_etag`). `complete` checks
  the parts S3 holds against the ETags recorded, has S3 assemble them (`complete_multipart_upload`), then streams
  that object into a temporary file. S3 wants every part but the last to be at least 5 MiB, hence
  MINT_UPLOAD_PART_BYTES's minimum. A failed S3 call is a 503 `s3_store_unavailable` that leaves the session as
  it was (a part not recorded, a session not opened), so the client sends the same request again.

Either way registration needs the whole file on local disk, to precheck and digest it before it is stored once
more as the revision's source: `complete` checks the whole file's digest and hands that file to
`revision_register` as the one-shot upload's `archive`: precheck, duplicate check, quota, store, validation and
export are exactly those of a one-shot upload. Abandoned sessions are collected with their parts (and their
multipart upload aborted) once past `expires_at` (beat: `upload_sessions_collect`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import tempfile
import uuid
from datetime import timedelta
from typing import BinaryIO

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone

from adapters import services, store, upload_gate
from adapters.models import Adapter, AdapterRevision, UploadPart, UploadSession, UploadState
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


class UploadIncomplete(Conflict):
    """409 `upload_incomplete`: `complete` was asked before every part arrived; `detail.missing` lists them."""

    code = "upload_incomplete"


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


def session_prefix(session: UploadSession) -> str:
    return f"t/{session.tenant_id}/uploads/{session.id.hex}"


def _whole_path(tenant_id: int, session_id: uuid.UUID) -> str:
    """The object an S3 session's multipart upload assembles into (under the session's prefix, so that
    removing the prefix removes it)."""
    return f"t/{tenant_id}/uploads/{session_id.hex}/whole"


def whole_path(session: UploadSession) -> str:
    return _whole_path(session.tenant_id, session.id)


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
    if not SHA256_HEX.match(digest):
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
    upload_id = store.multipart_start(bucket, _whole_path(tenant.id, session_id)) if bucket else ""
    try:
        session = _session_insert(
            adapter=adapter, by=by, session_id=session_id, upload_id=upload_id, declared=(size, digest, name)
        )
    except BaseException:
        if bucket is not None:
            _abort_quietly(bucket, _whole_path(tenant.id, session_id), upload_id)
        raise
    session.adapter = adapter
    return session


def _abort_quietly(bucket: store.S3Bucket, path: str, upload_id: str) -> None:
    """Abort a multipart upload nothing refers to, logging (not raising) a failure: the caller is already
    answering with another error, and a bucket lifecycle rule is the backstop for what is left behind."""
    try:
        store.multipart_abort(bucket, path, upload_id)
    except store.S3Unavailable:
        log.warning("could not abort S3 multipart upload %s of %s", upload_id, path, exc_info=True)


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
        services.check_storage_quota(locked, adding_bytes=reserved + size)
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


# ---------------------------------------------------------------- parts


def _read_bounded(stream: BinaryIO, limit: int) -> bytes:
    """At most `limit` bytes of `stream` (a request body), however it hands them out."""
    buffer = io.BytesIO()
    while buffer.tell() < limit:
        chunk = stream.read(min(CHUNK, limit - buffer.tell()))
        if not chunk:
            break
        buffer.write(chunk)
    return buffer.getvalue()


def _checked_number(session: UploadSession, number: int) -> int:
    count = session.part_count
    if not 1 <= number <= count:
        raise MintError(
            f"Part {number} does not exist: this upload has {count} part{'s' if count != 1 else ''}, "
            f"numbered 1 to {count}.",
            code="unknown_part",
            detail={"part": number, "parts": count},
        )
    return number


def _checked_part_digest(checksum: str | None) -> str:
    digest = (checksum or "").strip().lower()
    if not SHA256_HEX.match(digest):
        raise MintError(
            "Send the part's SHA-256 as 64 hexadecimal digits in the X-Mint-Part-Sha256 header.",
            code="missing_part_checksum" if not checksum else "bad_part_checksum",
        )
    return digest


def _conflict(number: int, held: str, sent: str) -> Conflict:
    return Conflict(
        f"Part {number} was already received with sha256 {held}; this one has {sent}. Parts cannot be replaced: "
        "delete the session and start again to send different bytes.",
        code="part_conflict",
        detail={"part": number, "received_sha256": held, "sha256": sent},
    )


def _size_mismatch(session: UploadSession, number: int, got: str, size: int) -> MintError:
    expected = session.expected_part_size(number)
    which = "every part but the last is part_size bytes" if number < session.part_count else "the last part"
    return MintError(
        f"Part {number} must be exactly {expected} bytes ({which}); this body has {got}.",
        code="part_size_mismatch",
        detail={"part": number, "expected": expected, "size": size},
    )


def _delete_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        store.artifact_storage().delete(path)


def _not_open(session: UploadSession) -> Conflict:
    return Conflict(
        f"Upload session {session.id} is {session.state}; it takes no more parts.",
        code="upload_not_open",
        detail={"state": session.state},
    )


def upload_part_put(
    *, session: UploadSession, number: int, body: BinaryIO, checksum: str | None, declared_length: int | None = None
) -> UploadPart:
    """Store part `number` of an open session from `body`, read with a bound of the part's length + 1.

    Nothing is stored for a refused part: an unknown number, a missing or malformed checksum header, a body
    that is not exactly the part's expected length (`part_size_mismatch`) or whose SHA-256 is not the header's
    (`part_checksum_mismatch`). A part already received with the same digest is accepted again without being
    stored twice; with another digest it is a `part_conflict`. Each part pushes the session's expiry back.

    The bytes are stored first, under a name of their own digest, then recorded under a short lock of the
    session row: of two senders of one part only one row wins, and a loser never overwrote the winner's bytes.
    """
    if session.state != UploadState.OPEN:
        raise _not_open(session)
    _checked_number(session, number)
    digest = _checked_part_digest(checksum)
    held = next((p for p in session.parts.all() if p.number == number), None)
    if held is not None and held.sha256 != digest:
        raise _conflict(number, held.sha256, digest)
    expected = session.expected_part_size(number)
    if declared_length is not None and declared_length != expected:
        raise _size_mismatch(session, number, f"{declared_length} (its Content-Length)", declared_length)
    data = _read_bounded(body, expected + 1)
    if len(data) != expected:
        raise _size_mismatch(
            session, number, f"more than {expected}" if len(data) > expected else str(len(data)), len(data)
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise MintError(
            f"Part {number}'s bytes have sha256 {actual}, not the {digest} of its X-Mint-Part-Sha256 header: it was "
            "damaged on the way; send it again.",
            code="part_checksum_mismatch",
            detail={"part": number, "expected": digest, "actual": actual},
        )
    if held is not None:
        _touch(session)
        return held
    bucket = store.s3_bucket()
    if bucket is not None:
        return _s3_part_put(session, bucket, number=number, digest=digest, data=data)
    path = f"{session_prefix(session)}/part-{number}.{digest[:16]}"
    store.save_file(path, io.BytesIO(data))
    del data
    try:
        with transaction.atomic():
            locked = UploadSession.objects.select_for_update().filter(id=session.id).first()
            if locked is None:  # collected meanwhile
                raise NotFound("Not found.")
            if locked.state != UploadState.OPEN:
                raise _not_open(locked)
            existing = UploadPart.objects.filter(session=locked, number=number).first()
            if existing is None:
                part = UploadPart.objects.create(
                    session=locked, number=number, size=expected, sha256=digest, store_path=path
                )
            elif existing.sha256 == digest:
                part = existing  # the same part sent twice at once: the same bytes under the same name
            else:
                raise _conflict(number, existing.sha256, digest)
            _touch(locked)
    except (MintError, IntegrityError):
        if not UploadPart.objects.filter(session_id=session.id, store_path=path).exists():
            _delete_file(path)
        raise
    return part


def _s3_part_put(
    session: UploadSession, bucket: store.S3Bucket, *, number: int, digest: str, data: bytes
) -> UploadPart:
    """Send a checked part to the session's multipart upload, then record it with its ETag.

    S3 keeps one part per number, so of two senders of different bytes for one number at once the loser may
    have replaced the winner's bytes: `complete` finds that from the ETags and asks for the part again. An
    upload S3 no longer knows (expired by a bucket rule) is started afresh, and its parts must be sent again.
    """
    path = whole_path(session)
    upload_id = session.s3_upload_id
    if not upload_id:  # assembled by a `complete` that every part had reached: none can be missing
        raise Conflict(
            f"Upload session {session.id} already has its parts assembled; complete it.", code="upload_assembled"
        )
    try:
        etag = store.multipart_put(bucket, path, upload_id, number, data)
    except store.MultipartUploadGone:
        upload_id = _s3_restart(session, bucket, gone=upload_id)
        try:
            etag = store.multipart_put(bucket, path, upload_id, number, data)
        except store.MultipartUploadGone:
            raise store.S3Unavailable(
                "The S3 artifact store lost this upload's multipart upload twice; try again.",
                detail={"operation": "store an upload part"},
            ) from None
    with transaction.atomic():
        locked = UploadSession.objects.select_for_update().filter(id=session.id).first()
        if locked is None:  # collected meanwhile
            raise NotFound("Not found.")
        if locked.state != UploadState.OPEN:
            raise _not_open(locked)
        if locked.s3_upload_id != upload_id:
            raise Conflict(
                f"Upload session {session.id} started its multipart upload again while part {number} was sent; "
                "send the part again.",
                code="upload_restarted",
            )
        existing = UploadPart.objects.filter(session=locked, number=number).first()
        if existing is None:
            part = UploadPart.objects.create(
                session=locked, number=number, size=len(data), sha256=digest, store_path=path, s3_etag=etag
            )
        elif existing.sha256 == digest:
            part = existing  # the same part sent twice at once: the same bytes, the same ETag
        else:
            raise _conflict(number, existing.sha256, digest)
        _touch(locked)
    return part


def _s3_restart(session: UploadSession, bucket: store.S3Bucket, *, gone: str) -> str:
    """Give the session a new multipart upload in place of `gone` (one S3 lost, or "" for parts assembled into
    a wrong file) and drop its part rows: they are to be sent again. Returns the session's upload id now.

    The swap is a conditional update: of two requests that find the same upload gone, one swaps and the other
    aborts the upload it started and takes the winner's.
    """
    fresh = store.multipart_start(bucket, whole_path(session))
    with transaction.atomic():
        swapped = UploadSession.objects.filter(id=session.id, state=UploadState.OPEN, s3_upload_id=gone).update(
            s3_upload_id=fresh
        )
        if swapped:
            UploadPart.objects.filter(session_id=session.id).delete()
    if not swapped:
        _abort_quietly(bucket, whole_path(session), fresh)
        current = UploadSession.objects.filter(id=session.id).first()
        if current is None:
            raise NotFound("Not found.")
        if current.state != UploadState.OPEN:
            raise _not_open(current)
        fresh = current.s3_upload_id
    session.s3_upload_id = fresh
    return fresh


def _touch(session: UploadSession) -> None:
    """Push the session's expiry back to a full TTL from now (it is being worked on)."""
    expires = timezone.now() + timedelta(seconds=settings.MINT_UPLOAD_SESSION_TTL_S)
    UploadSession.objects.filter(id=session.id, state=UploadState.OPEN).update(expires_at=expires)
    session.expires_at = expires


def _delete_parts(session: UploadSession) -> None:
    """Remove the session's stored parts and their rows (the store first: a row never names a missing file).

    On S3 its multipart upload is aborted (the upload id read again: a restart may have replaced it).
    """
    upload_id = UploadSession.objects.filter(id=session.id).values_list("s3_upload_id", flat=True).first()
    bucket = store.s3_bucket()
    if upload_id and bucket is not None:
        store.multipart_abort(bucket, whole_path(session), upload_id)
    with store.s3_errors("remove the upload's stored parts"):
        store.delete_prefix(session_prefix(session))
    UploadPart.objects.filter(session_id=session.id).delete()


# ---------------------------------------------------------------- complete and abort


def _claim(session: UploadSession) -> None:
    """Mark the session as being completed (a conditional update on its row), or 409 if another is at it."""
    now = timezone.now()
    free = Q(completing_since__isnull=True) | Q(completing_since__lt=now - timedelta(seconds=COMPLETE_CLAIM_S))
    if UploadSession.objects.filter(Q(id=session.id, state=UploadState.OPEN) & free).update(completing_since=now):
        return
    current = UploadSession.objects.filter(id=session.id).first()
    if current is None:
        raise NotFound("Not found.")
    if current.state != UploadState.OPEN:
        raise _not_open(current)
    raise Conflict(
        f"Upload session {session.id} is being completed by another request; GET it to see when it is done.",
        code="upload_completing",
    )


def _release(session: UploadSession) -> None:
    UploadSession.objects.filter(id=session.id, state=UploadState.OPEN).update(completing_since=None)


def _assemble(session: UploadSession, parts: list[UploadPart]) -> tuple[str, str]:
    """Concatenate the stored parts, in order, into a new temporary file; returns its path and SHA-256.

    Streams one chunk at a time; each part is checked against the digest it was received with as it is read.
    The caller owns (and removes) the file.
    """
    storage = store.artifact_storage()
    whole = hashlib.sha256()
    fd, path = tempfile.mkstemp(prefix="mint-upload-", dir=settings.FILE_UPLOAD_TEMP_DIR)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                piece = hashlib.sha256()
                length = 0
                with storage.open(part.store_path, "rb") as source:
                    while chunk := source.read(CHUNK):
                        piece.update(chunk)
                        whole.update(chunk)
                        length += len(chunk)
                        out.write(chunk)
                if length != part.size or piece.hexdigest() != part.sha256:
                    raise OSError(f"stored part {part.number} of upload {session.id} changed since it was received")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return path, whole.hexdigest()


def _s3_assemble(session: UploadSession, bucket: store.S3Bucket, parts: list[UploadPart]) -> tuple[str, str]:
    """Have S3 assemble the session's multipart upload, then stream that object into a new temporary file;
    returns its path and SHA-256 (the caller owns the file).

    The parts S3 holds are first checked against the ETags recorded: one it lost, or whose bytes a losing
    sender replaced, has its row dropped and the complete is a 409 `upload_incomplete` naming it (the upload
    S3 lost altogether is started afresh, every part missing). Once assembled, the session's `s3_upload_id` is
    cleared: a later `complete` (registration refused this one) reads the object again.
    """
    path = whole_path(session)
    upload_id = session.s3_upload_id
    if upload_id:
        try:
            held = store.multipart_parts(bucket, path, upload_id)
        except store.MultipartUploadGone:
            _s3_restart(session, bucket, gone=upload_id)  # its part rows go with it
            held = {}
        lost = [p.number for p in parts if held.get(p.number) != p.s3_etag]
        if lost:
            UploadPart.objects.filter(session_id=session.id, number__in=lost).delete()
            raise UploadIncomplete(
                f"The S3 store does not hold {len(lost)} of upload session {session.id}'s parts as they were "
                "received; send them again, then complete it.",
                detail={"missing": lost[:1000], "parts": session.part_count},
            )
        store.multipart_complete(bucket, path, upload_id, [(p.number, p.s3_etag) for p in parts])
        UploadSession.objects.filter(id=session.id, s3_upload_id=upload_id).update(s3_upload_id="")
        session.s3_upload_id = ""
    try:
        return _s3_download(session, bucket, path)
    except FileNotFoundError:  # the assembled object was removed behind our back: start again
        _s3_restart(session, bucket, gone="")
        raise UploadIncomplete(
            f"The S3 store lost upload session {session.id}'s assembled file; send every part again, then complete it.",
            detail={"missing": list(range(1, session.part_count + 1))[:1000], "parts": session.part_count},
        ) from None


def _s3_download(session: UploadSession, bucket: store.S3Bucket, path: str) -> tuple[str, str]:
    """Stream the object `path` (at most the declared size) into a new temporary file; its path and SHA-256."""
    whole = hashlib.sha256()
    length = 0
    fd, local = tempfile.mkstemp(prefix="mint-upload-", dir=settings.FILE_UPLOAD_TEMP_DIR)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in store.s3_chunks(bucket, path, CHUNK):
                length += len(chunk)
                if length > session.size:
                    break  # never more than declared is read
                whole.update(chunk)
                out.write(chunk)
        if length != session.size:
            raise OSError(f"the assembled object of upload {session.id} has {length} bytes, not {session.size}")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local)
        raise
    return local, whole.hexdigest()


def _drop_received(session: UploadSession) -> None:
    """Forget every received part, so that all are sent again (the assembled file's digest was wrong)."""
    bucket = store.s3_bucket()
    if bucket is None:
        _delete_parts(session)
        return
    _s3_restart(session, bucket, gone=session.s3_upload_id)
    try:  # a stale assembled object is harmless: the next assembly replaces it, abort and collection remove it
        with store.s3_errors("remove the assembled upload"):
            store.artifact_storage().delete(whole_path(session))
    except (store.S3Unavailable, FileNotFoundError):
        log.warning("could not remove the assembled file of upload session %s", session.id, exc_info=True)


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
        raise _not_open(session)
    _claim(session)
    try:
        parts = list(UploadPart.objects.filter(session_id=session.id).order_by("number"))
        missing = sorted(set(range(1, session.part_count + 1)) - {p.number for p in parts})
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (", …" if len(missing) > 20 else "")
            raise UploadIncomplete(
                f"Upload session {session.id} misses {len(missing)} of its {session.part_count} parts ({shown}); "
                "send them, then complete it.",
                detail={"missing": missing[:1000], "parts": session.part_count},
            )
        bucket = store.s3_bucket()
        path, digest = _s3_assemble(session, bucket, parts) if bucket else _assemble(session, parts)
        try:
            if digest != session.sha256:
                _drop_received(session)
                raise MintError(
                    f"The assembled file has sha256 {digest}, not the declared {session.sha256}. Its parts were "
                    "dropped: send every part again (or, if the declared digest was wrong, open a new session).",
                    code="upload_checksum_mismatch",
                    detail={"expected": session.sha256, "actual": digest, "received": []},
                )
            archive = ClosedUploadedFile(path, session.filename, "application/octet-stream", session.size, None)
            archive.sha256 = digest  # what registration's source digest is built from (no second read)
            revision = services.revision_register(
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
        _delete_parts(session)
    except store.S3Unavailable:  # the revision is registered: the collector removes what is left later
        log.warning("could not remove the parts of completed upload session %s", session.id, exc_info=True)
    return revision


def upload_session_abort(*, session: UploadSession, by: Actor) -> None:
    """Abort a session and remove its parts. An aborted or completed one is left as it is (its parts are gone);
    one being completed right now is 409 `upload_completing`."""
    now = timezone.now()
    free = Q(completing_since__isnull=True) | Q(completing_since__lt=now - timedelta(seconds=COMPLETE_CLAIM_S))
    with transaction.atomic():
        aborted = UploadSession.objects.filter(Q(id=session.id, state=UploadState.OPEN) & free).update(
            state=UploadState.ABORTED, completing_since=None
        )
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
    _delete_parts(session)


# ---------------------------------------------------------------- garbage collection


def upload_sessions_collect(*, now=None, batch: int = COLLECT_BATCH) -> int:
    """Delete sessions past their expiry (open, completed or aborted) with their stored parts; returns how many.

    An open one that is being completed is left until its claim is stale: its file may be being registered.
    """
    now = now or timezone.now()
    stale_claim = now - timedelta(seconds=COMPLETE_CLAIM_S)
    due = list(
        UploadSession.objects.filter(expires_at__lte=now)
        .filter(Q(completing_since__isnull=True) | Q(completing_since__lt=stale_claim))
        .order_by("expires_at")[:batch]
    )
    collected = 0
    bucket = store.s3_bucket()
    for session in due:
        # An S3 session's multipart upload is aborted first, and the row kept if that fails (the next run tries
        # again): once the row is gone nothing names the upload. An expired session takes no parts (it is 404).
        if session.s3_upload_id and bucket is not None:
            try:
                store.multipart_abort(bucket, whole_path(session), session.s3_upload_id)
            except store.S3Unavailable:
                log.warning("could not abort the multipart upload of upload session %s", session.id, exc_info=True)
                continue
        # The row goes first (its part rows cascade), and only if no part pushed its expiry back meanwhile; a part
        # stored while it went finds no session to record it in and removes its own file.
        deleted, _ = UploadSession.objects.filter(id=session.id, expires_at__lte=now).delete()
        if deleted:
            try:
                with store.s3_errors("remove an expired upload's stored parts"):
                    store.delete_prefix(session_prefix(session))
            except store.S3Unavailable:
                log.warning("could not remove the stored parts of upload session %s", session.id, exc_info=True)
            collected += 1
    if collected:
        log.info("collected %d expired upload sessions", collected)
    return collected
