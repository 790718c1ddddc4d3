"""The artifact store: where uploads and frozen exports live (django-storages; a local directory by default).

Paths are `t/<tenant_id>/a/<adapter_id>/…`:
- `uploads/<token>/…`      the files of one registration, as uploaded (the revision's source)
- `r<n>/export/`           the frozen engine layout of revision n, plus policy_record.json
- `r<n>/.export-<token>/`  an export being written; never referenced by the catalog
Tenants may also stage artifacts under `t/<tenant_id>/incoming/` and register them by `source_uri`.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from django.core.files import File
from django.core.files.storage import FileSystemStorage, Storage, storages

from adapters.models import Adapter, AdapterRevision

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
