"""Celery tasks of the control plane (queue `control`): validate and export revisions.

Both take ids, are idempotent (a revision not in the state they work on is left
alone), retry only when the artifact store is unreachable, and turn any problem
with the artifact itself into `failed` with a reason a person can act on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from celery import shared_task
from django.conf import settings

from adapters import services, store
from adapters.artifacts.archive import ArchiveLimits, archive_kind, extract_archive
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.export import engine_layout, moe_layout_for, sha256_file, write_engine_layout
from adapters.artifacts.validate import ValidatedAdapter, ValidationLimits, validate_adapter_dir
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S

log = logging.getLogger(__name__)

MAX_RETRIES = 5


class StoreUnavailable(Exception):
    """The artifact store could not be read or written; worth retrying."""


def validation_limits() -> ValidationLimits:
    return ValidationLimits(
        max_header_bytes=settings.MINT_SAFETENSORS_MAX_HEADER_BYTES,
        max_tensors=settings.MINT_MAX_TENSORS,
        archive=ArchiveLimits(
            max_files=settings.MINT_ARCHIVE_MAX_FILES,
            max_total_bytes=settings.MINT_ARCHIVE_MAX_BYTES,
            max_compression_ratio=settings.MINT_ARCHIVE_MAX_RATIO,
        ),
    )


@contextmanager
def workdir(revision: AdapterRevision):
    path = Path(tempfile.mkdtemp(prefix=f"mint-r{revision.id}-", dir=settings.MINT_WORK_DIR))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _load(revision_id: int) -> AdapterRevision | None:
    return (
        AdapterRevision.objects.select_related("adapter__tenant", "adapter__base_model", "parent", "created_by")
        .filter(id=revision_id)
        .first()
    )


def materialize_source(revision: AdapterRevision, work: Path) -> tuple[Path, str]:
    """Copy the revision's source into `work` (unpacking an archive). Returns (adapter dir, source digest)."""
    source = revision.source_uri
    try:
        files = store.list_files(source)
        local_root = work / "source"
        if not files and store.exists(source):  # a single file registered by source_uri
            target = local_root / Path(source).name
            store.download(source, target)
        elif files:
            store.download_prefix(source, local_root)
        else:
            raise ArtifactError("source_missing", f"The artifact at {source} is gone from the store.")
    except (ArtifactError, FileNotFoundError) as exc:
        if isinstance(exc, ArtifactError):
            raise
        raise ArtifactError("source_missing", f"The artifact at {source} is gone from the store.") from exc
    except OSError as exc:
        raise StoreUnavailable(str(exc)) from exc

    local_files = sorted(p for p in local_root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in local_files:
        digest.update(f"{path.relative_to(local_root).as_posix()}\0{sha256_file(path)}\n".encode())
    if len(local_files) == 1 and archive_kind(local_files[0]) is not None:
        unpacked = work / "unpacked"
        extract_archive(local_files[0], unpacked, validation_limits().archive)
        return unpacked, digest.hexdigest()
    return local_root, digest.hexdigest()


def _retry_or_fail(task, revision: AdapterRevision, exc: StoreUnavailable) -> None:
    if task.request.retries >= MAX_RETRIES:
        services.revision_fail(
            revision=revision,
            code="store_unavailable",
            reason=f"The artifact store stayed unreachable after {MAX_RETRIES} retries: {exc}",
        )
        return
    raise task.retry(exc=exc, countdown=min(60, 2 ** (task.request.retries + 1)))


@shared_task(bind=True, acks_late=True, ignore_result=True, max_retries=MAX_RETRIES)
def revision_validate(self, *, revision_id: int) -> None:
    """registered → validated (then export is queued), or → failed naming the problem."""
    revision = _load(revision_id)
    if revision is None or revision.state != S.REGISTERED:
        log.info("validate r%s: nothing to do (%s)", revision_id, revision.state if revision else "gone")
        return
    with workdir(revision) as work:
        try:
            adapter_dir, digest = materialize_source(revision, work)
            checked = validate_adapter_dir(adapter_dir, revision.adapter.base_model.spec, validation_limits())
        except ArtifactError as exc:
            services.revision_fail(revision=revision, code=exc.code, reason=exc.message)
            return
        except StoreUnavailable as exc:
            _retry_or_fail(self, revision, exc)
            return
    services.revision_mark_validated(
        revision=revision,
        rank=checked.rank,
        alpha=checked.alpha,
        target_modules=checked.target_modules,
        sha256=digest,
        size_bytes=revision.size_bytes or checked.size_bytes,
    )


def policy_record(revision: AdapterRevision, checked: ValidatedAdapter, files: list[dict], *, moe_layout: str) -> dict:
    """What a frozen export is: who, which base model, which hyper-parameters, which files with which hashes.

    Also how to load it: `engine_layout`, the node flags it needs (`engine_flags`,
    `min_max_lora_rank`) and the extras the load request must carry (`load_request`).
    """
    adapter = revision.adapter
    return {
        "format": "mint.policy_record/1",
        "tenant": adapter.tenant.slug,
        "adapter": adapter.name,
        "revision": revision.number,
        "base_model": adapter.base_model.name,
        "architecture": adapter.base_model.architecture,
        "rank": checked.rank,
        "alpha": checked.alpha,
        "target_modules": checked.target_modules,
        "dtype": checked.dtype,
        "tensor_count": checked.tensor_count,
        "source_layout": checked.layout,
        **engine_layout(checked, adapter.base_model.spec, moe_layout=moe_layout).as_record(),
        "training_step": revision.training_step,
        "parent": revision.parent.number if revision.parent else None,
        "source_sha256": revision.sha256,
        "registered_by": revision.created_by.get_username() if revision.created_by else None,
        "registered_at": revision.created_at.isoformat(),
        "files": files,
    }


def _slow_export_for_tests(path: str) -> None:
    # A test hook: lets the suite kill a worker in the middle of an export. Zero in real use.
    if settings.MINT_TEST_EXPORT_DELAY_MS:
        time.sleep(settings.MINT_TEST_EXPORT_DELAY_MS / 1000)


@shared_task(bind=True, acks_late=True, ignore_result=True, max_retries=MAX_RETRIES)
def revision_export(self, *, revision_id: int) -> None:
    """validated → exported: freeze the engine layout and policy_record.json under r<n>/export/.

    Also restores the export of an exported/approved revision whose files were removed,
    and checks the result is byte-identical to what was recorded the first time.
    """
    revision = _load(revision_id)
    if revision is None:
        return
    restoring = revision.state in (S.EXPORTED, S.PENDING_APPROVAL, S.APPROVED)
    if not (revision.state == S.VALIDATED or (restoring and not services.export_is_complete(revision))):
        log.info("export r%s: nothing to do (%s)", revision_id, revision.state)
        return
    store.delete_prefixes(store.staging_prefixes(revision))  # left by an interrupted run
    with workdir(revision) as work:
        try:
            adapter_dir, digest = materialize_source(revision, work)
            if restoring and digest != revision.sha256:
                raise ArtifactError("source_changed", "The source changed since validation; it cannot be re-exported.")
            spec = revision.adapter.base_model.spec
            if restoring and (revision.policy_record or {}).get("engine_layout") == "peft":
                spec = None  # frozen before packing existed: restore it as it was
            checked = validate_adapter_dir(adapter_dir, revision.adapter.base_model.spec, validation_limits())
            # The base model's choice of MoE layout; a frozen export keeps the one it was made with.
            frozen = revision.policy_record if restoring else None
            moe_layout = moe_layout_for(revision.adapter.base_model.config, frozen)
            out = work / "export"
            files = [
                {"name": f.name, "sha256": f.sha256, "size_bytes": f.size_bytes}
                for f in write_engine_layout(checked, out, spec=spec, moe_layout=moe_layout)
            ]
            if restoring and files != revision.policy_record["files"]:
                raise ArtifactError("export_mismatch", "Re-exporting gave different bytes than the frozen export.")
            record = frozen if restoring else policy_record(revision, checked, files, moe_layout=moe_layout)
            (out / "policy_record.json").write_text(json.dumps(record, sort_keys=True, indent=2) + "\n")
            staging = store.new_export_staging_prefix(revision)
            store.upload_dir(out, staging, after_each=_slow_export_for_tests)
        except ArtifactError as exc:
            if restoring:
                log.error("re-export of %s failed: %s", revision, exc.message)
                return
            services.revision_fail(revision=revision, code=exc.code, reason=exc.message)
            return
        except (StoreUnavailable, OSError) as exc:
            _retry_or_fail(self, revision, StoreUnavailable(str(exc)))
            return
    if restoring:
        services.revision_restore_export(revision=revision, staging=staging)
    else:
        services.revision_mark_exported(revision=revision, staging=staging, policy_record=record)
