"""The parts of a resumable upload (adapters/uploads.py) in the artifact store: each checked and stored as it
arrives, then assembled into one local file when the session completes.

A filesystem store keeps each part as a file under `t/<tenant_id>/uploads/<session>/`, named by its digest;
assembling concatenates them, in order, into one temporary file, checking each against the digest it came with.
The S3 store sends them to the session's multipart upload of the object `t/<tenant_id>/uploads/<session>/whole`
(its UploadId in `s3_upload_id`, each part's ETag in `s3_etag`); assembling checks the parts S3 holds against the
ETags recorded, has S3 assemble them (`complete_multipart_upload`), then streams that object into a temporary file.
S3 wants every part but the last to be at least 5 MiB, hence MINT_UPLOAD_PART_BYTES's minimum. An upload S3 lost
is started afresh (`_s3_restart`) and its parts are to be sent again.
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
from django.utils import timezone

from adapters import store
from adapters.models import UploadPart, UploadSession, UploadState
from mint_site.errors import Conflict, MintError, NotFound

log = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1024 * 1024


class UploadIncomplete(Conflict):
    """409 `upload_incomplete`: `complete` was asked before every part arrived; `detail.missing` lists them."""

    code = "upload_incomplete"


def session_prefix(session: UploadSession) -> str:
    return f"t/{session.tenant_id}/uploads/{session.id.hex}"


def whole_path_for(tenant_id: int, session_id: uuid.UUID) -> str:
    """The object an S3 session's multipart upload assembles into (under the session's prefix, so that
    removing the prefix removes it)."""
    return f"t/{tenant_id}/uploads/{session_id.hex}/whole"


def whole_path(session: UploadSession) -> str:
    return whole_path_for(session.tenant_id, session.id)


def abort_quietly(bucket: store.S3Bucket, path: str, upload_id: str) -> None:
    """Abort a multipart upload nothing refers to, logging (not raising) a failure: the caller is already
    answering with another error, and a bucket lifecycle rule is the backstop for what is left behind."""
    try:
        store.multipart_abort(bucket, path, upload_id)
    except store.S3Unavailable:
        log.warning("could not abort S3 multipart upload %s of %s", upload_id, path, exc_info=True)


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


def not_open(session: UploadSession) -> Conflict:
    return Conflict(
        f"Upload session {session.id} is {session.state}; it takes no more parts.",
        code="upload_not_open",
        detail={"state": session.state},
    )


def _locked_open(session: UploadSession) -> UploadSession:
    """The session's row, locked for this transaction, if it still takes parts."""
    locked = UploadSession.objects.select_for_update().filter(id=session.id).first()
    if locked is None:  # collected meanwhile
        raise NotFound("Not found.")
    if locked.state != UploadState.OPEN:
        raise not_open(locked)
    return locked


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
        raise not_open(session)
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
            locked = _locked_open(session)
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
        locked = _locked_open(session)
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
        abort_quietly(bucket, whole_path(session), fresh)
        current = UploadSession.objects.filter(id=session.id).first()
        if current is None:
            raise NotFound("Not found.")
        if current.state != UploadState.OPEN:
            raise not_open(current)
        fresh = current.s3_upload_id
    session.s3_upload_id = fresh
    return fresh


def _touch(session: UploadSession) -> None:
    """Push the session's expiry back to a full TTL from now (it is being worked on)."""
    expires = timezone.now() + timedelta(seconds=settings.MINT_UPLOAD_SESSION_TTL_S)
    UploadSession.objects.filter(id=session.id, state=UploadState.OPEN).update(expires_at=expires)
    session.expires_at = expires


def delete_parts(session: UploadSession) -> None:
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


def _assemble_files(session: UploadSession, parts: list[UploadPart]) -> tuple[str, str]:
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


def drop_received(session: UploadSession) -> None:
    """Forget every received part, so that all are sent again (the assembled file's digest was wrong)."""
    bucket = store.s3_bucket()
    if bucket is None:
        delete_parts(session)
        return
    _s3_restart(session, bucket, gone=session.s3_upload_id)
    try:  # a stale assembled object is harmless: the next assembly replaces it, abort and collection remove it
        with store.s3_errors("remove the assembled upload"):
            store.artifact_storage().delete(whole_path(session))
    except (store.S3Unavailable, FileNotFoundError):
        log.warning("could not remove the assembled file of upload session %s", session.id, exc_info=True)


def assemble(session: UploadSession, parts: list[UploadPart]) -> tuple[str, str]:
    """The session's whole file, assembled from its received `parts` into a new temporary file (from the S3 store,
    or the files of a filesystem store); returns its path and SHA-256. The caller owns (and removes) the file."""
    bucket = store.s3_bucket()
    return _s3_assemble(session, bucket, parts) if bucket else _assemble_files(session, parts)
