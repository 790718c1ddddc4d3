"""The artifact store: where uploads and frozen exports live (django-storages; a local directory by default).

Paths are `t/<tenant_id>/a/<adapter_id>/…`:
- `uploads/<token>/…`      the files of one registration, as uploaded (the revision's source)
- `r<n>/export/`           the frozen engine layout of revision n, plus policy_record.json
- `r<n>/.export-<token>/`  an export being written; never referenced by the catalog
Tenants may also stage artifacts under `t/<tenant_id>/incoming/` and register them by `source_uri`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from django.core.files import File
from django.core.files.storage import FileSystemStorage, Storage, storages
from storages.backends.s3 import S3Storage

from adapters.models import Adapter, AdapterRevision
from mint_site.errors import MintError

CHUNK = 1024 * 1024


def artifact_storage() -> Storage:
    return storages["artifacts"]


def adapter_prefix(adapter: Adapter) -> str:
    return f"t/{adapter.tenant_id}/a/{adapter.id}"


def new_upload_prefix(adapter: Adapter) -> str:
    return f"{adapter_prefix(adapter)}/uploads/{uuid.uuid4().hex}"


def export_prefix(revision: AdapterRevision) -> str:
    return f"{adapter_prefix(revision.adapter)}/r{revision.number}/export"


def new_export_staging_prefix(revision: AdapterRevision) -> str:
    return f"{adapter_prefix(revision.adapter)}/r{revision.number}/.export-{uuid.uuid4().hex}"


def incoming_prefix(tenant_id: int) -> str:
    return f"t/{tenant_id}/incoming"


def clean_relative_path(path: str) -> str | None:
    """`path` as a normalised relative store path, or None if it escapes (absolute, `..`, empty)."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return None
    normal = posixpath.normpath(path)
    if normal in (".", "") or normal.startswith("..") or "/../" in f"/{normal}/":
        return None
    return normal


def list_files(prefix: str) -> list[str]:
    """Every file under `prefix`, recursively, as store paths, sorted."""
    storage = artifact_storage()
    found: list[str] = []
    pending = [prefix.rstrip("/")]
    while pending:
        current = pending.pop()
        try:
            dirs, files = storage.listdir(current)
        except (FileNotFoundError, NotADirectoryError):
            continue
        found += [f"{current}/{name}" for name in files]
        pending += [f"{current}/{name}" for name in dirs]
    return sorted(found)


def exists(path: str) -> bool:
    return artifact_storage().exists(path)


def save_file(path: str, fileobj) -> int:
    """Store one file under exactly `path` (streamed in chunks). Returns its size."""
    storage = artifact_storage()
    if storage.exists(path):
        storage.delete(path)
    # An uploaded file on disk is handed over as it is: a filesystem store then moves it instead of copying.
    content = fileobj if hasattr(fileobj, "temporary_file_path") else File(fileobj, name=posixpath.basename(path))
    saved = storage.save(path, content)
    if saved != path:  # a storage that renamed it would break the layout
        storage.delete(saved)
        raise OSError(f"artifact store renamed {path} to {saved}")
    return storage.size(path)


def download(path: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with artifact_storage().open(path, "rb") as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)


def download_prefix(prefix: str, dest: Path) -> list[Path]:
    """Copy every file under `prefix` to `dest`, keeping relative paths."""
    prefix = prefix.rstrip("/")
    local = []
    for path in list_files(prefix):
        relative = path[len(prefix) + 1 :]
        target = dest / relative
        download(path, target)
        local.append(target)
    return local


def upload_dir(local: Path, prefix: str) -> list[str]:
    """Copy every file under the local directory `local` to `prefix`."""
    written = []
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        path = f"{prefix}/{file.relative_to(local).as_posix()}"
        with open(file, "rb") as handle:
            save_file(path, handle)
        written.append(path)
    return written


def delete_prefix(prefix: str) -> None:
    """Remove everything under `prefix`. Missing is fine."""
    storage = artifact_storage()
    if isinstance(storage, FileSystemStorage):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(storage.path(prefix))
        return
    for path in list_files(prefix):
        storage.delete(path)


def delete_prefixes(prefixes: Iterable[str]) -> None:
    for prefix in prefixes:
        delete_prefix(prefix)


def export_is_complete(revision: AdapterRevision) -> bool:
    """Whether every file the revision's policy record lists is in the store under its export."""
    record = revision.policy_record or {}
    names = [f["name"] for f in record.get("files", [])]
    return bool(revision.export_uri and names) and all(exists(f"{revision.export_uri}/{n}") for n in names)


def staging_prefixes(revision: AdapterRevision) -> list[str]:
    """Export staging directories of a revision left behind by interrupted runs."""
    base = f"{adapter_prefix(revision.adapter)}/r{revision.number}"
    try:
        dirs, _ = artifact_storage().listdir(base)
    except FileNotFoundError:
        return []
    return [f"{base}/{name}" for name in dirs if name.startswith(".export-")]


def promote(staging: str, final: str) -> None:
    """Make the complete files under `staging` appear under `final`.

    On a local filesystem this is one atomic directory rename. On object stores, which
    have no rename, files are copied then the staging copy removed; the catalog points
    at `final` only after this returns, so a reader never sees a partial export.
    """
    storage = artifact_storage()
    if isinstance(storage, FileSystemStorage):
        source, target = storage.path(staging), storage.path(final)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)
        return
    delete_prefix(final)
    for path in list_files(staging):
        with storage.open(path, "rb") as handle:
            save_file(f"{final}/{path[len(staging) + 1 :]}", handle)
    delete_prefix(staging)


# ---------------------------------------------------------------- S3 multipart uploads (resumable uploads)


class S3Unavailable(MintError):
    """503 `s3_store_unavailable`: a call to the S3 artifact store failed (network, credentials, a 5xx)."""

    status_code = 503
    code = "s3_store_unavailable"


class MultipartUploadGone(Exception):
    """S3 no longer knows the multipart upload (NoSuchUpload): aborted, completed, or expired by a bucket rule."""


@dataclass(frozen=True)
class S3Bucket:
    """The bucket behind an S3 artifact store, reached with the storage's own boto3 client (its credentials)."""

    client: Any
    name: str
    location: str

    def key(self, path: str) -> str:
        return f"{self.location.strip('/')}/{path}" if self.location.strip("/") else path


def s3_bucket() -> S3Bucket | None:
    """The artifact store's S3 bucket, or None when the store is not S3 (a filesystem, by default)."""
    storage = artifact_storage()
    if not isinstance(storage, S3Storage):
        return None
    return S3Bucket(storage.connection.meta.client, storage.bucket_name, storage.location or "")


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """Turn a failed S3 call (boto3's, or django-storages' S3Storage's) into S3Unavailable saying what failed;
    NoSuchUpload into MultipartUploadGone and NoSuchKey into FileNotFoundError, which callers may mend."""
    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchUpload":
            raise MultipartUploadGone(what) from exc
        if code == "NoSuchKey":
            raise FileNotFoundError(what) from exc
        raise S3Unavailable(
            f"The S3 artifact store failed to {what} ({code or 'error'}); try again.",
            detail={"operation": what, "s3_code": code},
        ) from exc
    except BotoCoreError as exc:
        raise S3Unavailable(
            f"The S3 artifact store could not be reached to {what}; try again.", detail={"operation": what}
        ) from exc


def multipart_start(bucket: S3Bucket, path: str) -> str:
    """Start a multipart upload of the object `path`; returns its UploadId."""
    with s3_errors("start a multipart upload"):
        return bucket.client.create_multipart_upload(Bucket=bucket.name, Key=bucket.key(path))["UploadId"]


def multipart_put(bucket: S3Bucket, path: str, upload_id: str, number: int, data: bytes) -> str:
    """Send part `number` of the multipart upload (replacing one sent before); returns its ETag.

    Content-MD5 makes S3 refuse bytes damaged between here and there instead of storing them.
    """
    md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
    with s3_errors("store an upload part"):
        return bucket.client.upload_part(
            Bucket=bucket.name,
            Key=bucket.key(path),
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ContentMD5=md5,
        )["ETag"]


def multipart_parts(bucket: S3Bucket, path: str, upload_id: str) -> dict[int, str]:
    """The parts S3 holds for the multipart upload, as {PartNumber: ETag} (every page of them)."""
    held: dict[int, str] = {}
    with s3_errors("list the upload's parts"):
        pages = bucket.client.get_paginator("list_parts").paginate(
            Bucket=bucket.name, Key=bucket.key(path), UploadId=upload_id
        )
        for page in pages:
            held |= {part["PartNumber"]: part["ETag"] for part in page.get("Parts", [])}
    return held


def multipart_complete(bucket: S3Bucket, path: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
    """Assemble the object `path` from `parts` ((PartNumber, ETag), in order).

    An upload gone now (it was there when its parts were listed) is S3Unavailable too: the next attempt
    lists the parts again and finds it gone.
    """
    try:
        with s3_errors("assemble the upload's parts"):
            bucket.client.complete_multipart_upload(
                Bucket=bucket.name,
                Key=bucket.key(path),
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in parts]},
            )
    except MultipartUploadGone:
        raise S3Unavailable(
            "The S3 artifact store lost the upload's parts while assembling them; try again.",
            detail={"operation": "assemble the upload's parts", "s3_code": "NoSuchUpload"},
        ) from None


def multipart_abort(bucket: S3Bucket, path: str, upload_id: str) -> None:
    """Abort the multipart upload, so S3 drops (and stops billing) its parts. Already gone is fine."""
    with contextlib.suppress(MultipartUploadGone), s3_errors("abort a multipart upload"):
        bucket.client.abort_multipart_upload(Bucket=bucket.name, Key=bucket.key(path), UploadId=upload_id)


def s3_chunks(bucket: S3Bucket, path: str, chunk: int = CHUNK) -> Iterator[bytes]:
    """The object `path`, streamed in chunks of at most `chunk` bytes (one in memory at a time).

    Straight from boto3: django-storages' S3File would buffer the whole object in memory first.
    """
    with s3_errors("read the assembled upload"):
        body = bucket.client.get_object(Bucket=bucket.name, Key=bucket.key(path))["Body"]
        try:
            yield from body.iter_chunks(chunk)
        finally:
            body.close()
