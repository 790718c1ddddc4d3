"""The work of the control plane's tasks (adapters/tasks.py): validate and export revisions.

Both take ids, are idempotent (a revision not in the state they work on is left
alone), retry only when the artifact store is unreachable, and turn any problem
with the artifact itself into `failed` with a reason a person can act on.

A tenant's files are untrusted: everything that parses them (unpacking, validation,
writing the engine layout) runs in a child process under MINT_TASK_* bounds
(mint_site/sandbox.py), so a hostile upload fails its own revision (`<stage>_timeout`,
`<stage>_resources`) and costs the shared worker nothing. Store I/O stays in the worker:
it moves bytes the tenant's upload limit already bounds. Each delivery of a task is
counted on the revision (`deliveries`); one killed with its worker is delivered again,
and past MINT_TASK_MAX_DELIVERIES the revision fails rather than kill the next worker.
The workers take revisions from the fair control queue (adapters/dispatch.py), and record
when they begin one (`dispatch.begin`): a hand-off the broker lost before anyone began it is
handed over again soon, and a copy of a superseded hand-off does nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NoReturn

from django.conf import settings

from adapters import dispatch, store
from adapters.artifacts.archive import ArchiveLimits, archive_kind, extract_archive
from adapters.artifacts.digest import combined_digest
from adapters.artifacts.errors import ArtifactError
from adapters.artifacts.export import engine_layout, moe_layout_for, sha256_file, write_engine_layout
from adapters.artifacts.spec import BaseModelSpec
from adapters.artifacts.validate import ValidatedAdapter, ValidationLimits, adapter_member, validate_adapter_dir
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from adapters.services import registration, transitions
from mint_site.sandbox import Bounds, OutOfResources, TimeLimit, run_bounded

log = logging.getLogger(__name__)

MAX_RETRIES = 5


@dataclass(frozen=True)
class Delivery:
    """How this run of a task came: its retries so far, and how to ask for one more (Celery's `task.retry`,
    which raises; the countdown backs off exponentially, at most a minute)."""

    retries: int
    retry_task: Callable[..., NoReturn]

    def retry(self, exc: BaseException) -> NoReturn:
        self.retry_task(exc=exc, countdown=min(60, 2 ** (self.retries + 1)))


class StoreUnavailable(Exception):
    """The artifact store could not be read or written; worth retrying."""


def validation_limits() -> ValidationLimits:
    return ValidationLimits(
        max_header_bytes=settings.MINT_SAFETENSORS_MAX_HEADER_BYTES,
        max_total_header_bytes=settings.MINT_SAFETENSORS_MAX_TOTAL_HEADER_BYTES,
        max_tensors=settings.MINT_MAX_TENSORS,
        archive=ArchiveLimits(
            max_files=settings.MINT_ARCHIVE_MAX_FILES,
            max_total_bytes=settings.MINT_ARCHIVE_MAX_BYTES,
            max_compression_ratio=settings.MINT_ARCHIVE_MAX_RATIO,
            max_name_bytes=settings.MINT_ARCHIVE_MAX_NAME_BYTES,
            max_pax_header_bytes=settings.MINT_ARCHIVE_MAX_PAX_HEADER_BYTES,
            max_pax_records=settings.MINT_ARCHIVE_MAX_PAX_RECORDS,
            max_zip_directory_bytes=settings.MINT_ARCHIVE_MAX_ZIP_DIRECTORY_BYTES,
        ),
    )


def task_bounds(revision: AdapterRevision) -> Bounds:
    """The time and memory one validation or export may take (MINT_TASK_*), and its priority.

    A tenant with more revisions waiting behind this one is working through a backlog: its work runs
    at the lowest CPU and I/O priority from the start, so another tenant's revision, validated
    meanwhile, runs as if alone on the machine; any other work moves there once it has run
    MINT_TASK_DEMOTE_AFTER_S (benchmarks/noisy_neighbour_control.py measures both).
    """
    return Bounds(
        soft_time_s=settings.MINT_TASK_SOFT_TIME_LIMIT_S,
        hard_time_s=settings.MINT_TASK_TIME_LIMIT_S,
        memory_bytes=settings.MINT_TASK_MEMORY_MB * 1024 * 1024,
        background=dispatch.waiting(tenant_id=revision.adapter.tenant_id) > 0,
        demote_after_s=settings.MINT_TASK_DEMOTE_AFTER_S,
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


def download_source(source: str, work: Path) -> Path:
    """Copy a revision's source files from the store into `work`; returns their folder."""
    try:
        files = store.list_files(source)
        local_root = work / "source"
        if not files and store.exists(source):  # a single file registered by source_uri
            store.download(source, local_root / Path(source).name)
        elif files:
            store.download_prefix(source, local_root)
        else:
            raise ArtifactError("source_missing", f"The artifact at {source} is gone from the store.")
    except FileNotFoundError as exc:
        raise ArtifactError("source_missing", f"The artifact at {source} is gone from the store.") from exc
    except ArtifactError:
        raise
    except OSError as exc:
        raise StoreUnavailable(str(exc)) from exc
    return local_root


def source_digest(local_root: Path) -> str:
    """SHA-256 over the source's files (relative names and contents): what `AdapterRevision.sha256` records."""
    return combined_digest(
        (path.relative_to(local_root).as_posix(), sha256_file(path)) for path in local_root.rglob("*") if path.is_file()
    )


@contextmanager
def unpacked(local_root: Path, work: Path, limits: ArchiveLimits):
    """The adapter's folder: `local_root` itself, or where its one archive unpacks to (removed after).

    Untrusted, so sandboxed, removal included: an archive of 100,000 files costs as much to delete as
    to write, and that is the sandbox's time at the sandbox's priority, not the worker's.
    """
    files = [p for p in local_root.rglob("*") if p.is_file()]
    if not (len(files) == 1 and archive_kind(files[0]) is not None):
        yield local_root
        return
    target = work / "unpacked"
    try:
        extract_archive(files[0], target, limits, keep=adapter_member)  # other members are counted, not written
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)


@dataclass(frozen=True)
class Checked:
    """What validation learnt about an adapter, as the catalog records it."""

    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    sha256: str  # of the source files as uploaded


def _check(local_root: Path, work: Path, spec: BaseModelSpec, limits: ValidationLimits) -> Checked:
    """In the sandbox: hash the source, unpack and validate it."""
    digest = source_digest(local_root)
    with unpacked(local_root, work, limits.archive) as root:
        checked = validate_adapter_dir(root, spec, limits)
    return Checked(checked.rank, checked.alpha, checked.target_modules, checked.size_bytes, digest)


def _run_sandboxed(revision: AdapterRevision, stage: str, work, *args):
    """Run `work` under the task bounds; a time limit or a death becomes the revision's failure."""
    try:
        return run_bounded(work, *args, bounds=task_bounds(revision))
    except TimeLimit as exc:
        raise ArtifactError(
            f"{stage}_timeout",
            f"The {stage} of r{revision.number} was stopped: {exc}. The upload takes longer to check than "
            "this platform allows (MINT_TASK_SOFT_TIME_LIMIT_S); upload a smaller adapter, or ask an operator.",
        ) from None
    except OutOfResources as exc:
        raise ArtifactError(
            f"{stage}_resources",
            f"The {stage} of r{revision.number} was stopped: {exc}. Nothing a valid adapter needs takes that "
            "much (MINT_TASK_MEMORY_MB); check the upload is the adapter's files only.",
        ) from None


def _retry_or_fail(delivery: Delivery, revision: AdapterRevision, exc: StoreUnavailable) -> None:
    if delivery.retries >= MAX_RETRIES:
        transitions.revision_fail(
            revision=revision,
            code="store_unavailable",
            reason=f"The artifact store stayed unreachable after {MAX_RETRIES} retries: {exc}",
        )
        return
    transitions.revision_delivery_returned(revision=revision)  # a retry on purpose is not a lost delivery
    delivery.retry(exc)


def validate(revision_id: int, delivery: Delivery, *, handed: datetime | None = None) -> None:
    """registered → validated (then export is queued), or → failed naming the problem.

    `handed`: the hand-off this copy of the task came with (adapters/dispatch.py); a superseded one does nothing.
    """
    revision = _load(revision_id)
    if revision is None or revision.state != S.REGISTERED:
        log.info("validate r%s: nothing to do (%s)", revision_id, revision.state if revision else "gone")
        dispatch.control_dispatch()
        return
    if not dispatch.begin(revision, handed=handed):
        return
    if not transitions.revision_delivery_start(revision=revision, stage="validation"):
        return
    with workdir(revision) as work:
        try:
            local_root = download_source(revision.source_uri, work)
            spec = revision.adapter.base_model.spec
            checked = _run_sandboxed(revision, "validation", _check, local_root, work, spec, validation_limits())
        except ArtifactError as exc:
            transitions.revision_fail(revision=revision, code=exc.code, reason=exc.message)
            return
        except StoreUnavailable as exc:
            _retry_or_fail(delivery, revision, exc)
            return
    # A source first digested here (a `source_uri`; uploads were compared at registration) may duplicate another.
    if (
        not revision.sha256
        and not revision.allow_duplicate
        and registration.revision_fail_if_duplicate(revision=revision, sha256=checked.sha256) is not None
    ):
        return
    transitions.revision_mark_validated(
        revision=revision,
        rank=checked.rank,
        alpha=checked.alpha,
        target_modules=checked.target_modules,
        sha256=checked.sha256,
        size_bytes=revision.size_bytes or checked.size_bytes,
    )


def revision_facts(revision: AdapterRevision) -> dict:
    """What the catalog knows of a revision, for its policy record (read before the sandbox: it has no database)."""
    adapter = revision.adapter
    return {
        "tenant": adapter.tenant.slug,
        "adapter": adapter.name,
        "revision": revision.number,
        "base_model": adapter.base_model.name,
        "architecture": adapter.base_model.architecture,
        "training_step": revision.training_step,
        "parent": revision.parent.number if revision.parent else None,
        "source_sha256": revision.sha256,
        "registered_by": revision.created_by.get_username() if revision.created_by else None,
        "registered_at": revision.created_at.isoformat(),
    }


def policy_record(
    facts: dict, checked: ValidatedAdapter, spec: BaseModelSpec, files: list[dict], *, moe_layout: str
) -> dict:
    """What a frozen export is: who, which base model, which hyper-parameters, which files with which hashes.

    Also how to load it: `engine_layout`, the node flags it needs (`engine_flags`,
    `min_max_lora_rank`) and the extras the load request must carry (`load_request`).
    """
    return {
        "format": "mint.policy_record/1",
        "tenant": facts["tenant"],
        "adapter": facts["adapter"],
        "revision": facts["revision"],
        "base_model": facts["base_model"],
        "architecture": facts["architecture"],
        "rank": checked.rank,
        "alpha": checked.alpha,
        "target_modules": checked.target_modules,
        "dtype": checked.dtype,
        "tensor_count": checked.tensor_count,
        "source_layout": checked.layout,
        **engine_layout(checked, spec, moe_layout=moe_layout).as_record(),
        "training_step": facts["training_step"],
        "parent": facts["parent"],
        "source_sha256": facts["source_sha256"],
        "registered_by": facts["registered_by"],
        "registered_at": facts["registered_at"],
        "files": files,
    }


@dataclass(frozen=True)
class ExportJob:
    """One export as the sandboxed writer needs it: no model objects, nothing that reaches the database."""

    spec: BaseModelSpec
    pack_spec: BaseModelSpec | None  # None: write the PEFT layout as it was frozen before packing existed
    moe_layout: str
    facts: dict
    limits: ValidationLimits
    frozen: dict | None  # the policy record of a revision being restored; its files must come out identical
    sha256: str | None  # restoring: the source must still hash to what validation recorded


def _write_export(job: ExportJob, local_root: Path, work: Path) -> tuple[Path, dict]:
    """In the sandbox: unpack, validate and write the engine layout plus policy_record.json under work/export."""
    if job.sha256 is not None and source_digest(local_root) != job.sha256:
        raise ArtifactError("source_changed", "The source changed since validation; it cannot be re-exported.")
    out = work / "export"
    with unpacked(local_root, work, job.limits.archive) as root:
        checked = validate_adapter_dir(root, job.spec, job.limits)
        files = [
            {"name": f.name, "sha256": f.sha256, "size_bytes": f.size_bytes}
            for f in write_engine_layout(checked, out, spec=job.pack_spec, moe_layout=job.moe_layout)
        ]
        if job.frozen is not None and files != job.frozen["files"]:
            raise ArtifactError("export_mismatch", "Re-exporting gave different bytes than the frozen export.")
        record = job.frozen or policy_record(job.facts, checked, job.spec, files, moe_layout=job.moe_layout)
    (out / "policy_record.json").write_text(json.dumps(record, sort_keys=True, indent=2) + "\n")
    return out, record


def export(revision_id: int, delivery: Delivery, *, handed: datetime | None = None) -> None:
    """validated → exported: freeze the engine layout and policy_record.json under r<n>/export/.

    Also restores the export of an exported/approved revision whose files were removed,
    and checks the result is byte-identical to what was recorded the first time; one such
    re-export at a time (`dispatch.restore_begin`).
    """
    revision = _load(revision_id)
    if revision is None:
        dispatch.control_dispatch()
        return
    restoring = revision.state in dispatch.RESTORABLE_STATES
    if not (revision.state == S.VALIDATED or (restoring and not store.export_is_complete(revision))):
        log.info("export r%s: nothing to do (%s)", revision_id, revision.state)
        dispatch.control_dispatch()
        return
    if restoring:
        if not dispatch.restore_begin(revision):
            return
        restored = False
        try:
            restored = _export(revision, delivery, restoring=True)
        finally:
            dispatch.restore_end(revision, restored=restored)
        return
    if not dispatch.begin(revision, handed=handed):
        return
    if not transitions.revision_delivery_start(revision=revision, stage="export"):
        return
    _export(revision, delivery, restoring=False)


def _export(revision: AdapterRevision, delivery: Delivery, *, restoring: bool) -> bool:
    """Write the export (or restore it); True once it is published, False if the revision failed or it gave up."""
    store.delete_prefixes(store.staging_prefixes(revision))  # left by an interrupted run
    base_model = revision.adapter.base_model
    frozen = revision.policy_record if restoring else None
    job = ExportJob(
        spec=base_model.spec,
        # Frozen before packing existed: restore it as it was.
        pack_spec=None if restoring and (frozen or {}).get("engine_layout") == "peft" else base_model.spec,
        # The base model's choice of MoE layout; a frozen export keeps the one it was made with.
        moe_layout=moe_layout_for(base_model.config, frozen),
        facts=revision_facts(revision),
        limits=validation_limits(),
        frozen=frozen,
        sha256=revision.sha256 if restoring else None,
    )
    with workdir(revision) as work:
        try:
            local_root = download_source(revision.source_uri, work)
            out, record = _run_sandboxed(revision, "export", _write_export, job, local_root, work)
            staging = store.new_export_staging_prefix(revision)
            store.upload_dir(out, staging)
        except ArtifactError as exc:
            if restoring:
                log.error("re-export of %s failed: %s", revision, exc.message)
                return False
            transitions.revision_fail(revision=revision, code=exc.code, reason=exc.message)
            return False
        except (StoreUnavailable, OSError) as exc:
            if restoring:
                delivery.retry(exc)
            _retry_or_fail(delivery, revision, StoreUnavailable(str(exc)))
            return False
    if restoring:
        transitions.revision_restore_export(revision=revision, staging=staging)
    else:
        transitions.revision_mark_exported(revision=revision, staging=staging, policy_record=record)
    return True
