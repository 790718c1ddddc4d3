"""Celery tasks of the control plane (queue `control`). Thin: each loads nothing itself and calls one
function of adapters/pipeline.py (validation, export) or of the fair queue and the upload collector."""

from __future__ import annotations

from datetime import datetime

from celery import shared_task

from adapters import collect, dispatch, pipeline, uploads
from adapters.dispatch import TASK_LIMITS
from adapters.pipeline import MAX_RETRIES, Delivery


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


@shared_task(bind=True, acks_late=True, ignore_result=True, max_retries=MAX_RETRIES, **TASK_LIMITS)
def revision_validate(self, *, revision_id: int, handed: str | None = None) -> None:
    """registered → validated (then export is queued), or → failed naming the problem."""
    pipeline.validate(revision_id, Delivery(self.request.retries, self.retry), handed=_when(handed))


@shared_task(bind=True, acks_late=True, ignore_result=True, max_retries=MAX_RETRIES, **TASK_LIMITS)
def revision_export(self, *, revision_id: int, handed: str | None = None) -> None:
    """validated → exported: freeze the engine layout and policy_record.json under r<n>/export/.

    Also restores the export of an exported/approved revision whose files were removed.
    """
    pipeline.export(revision_id, Delivery(self.request.retries, self.retry), handed=_when(handed))


@shared_task(ignore_result=True)
def control_dispatch() -> None:
    """Beat: hand waiting revisions to the workers, and probe the queue behind hand-offs nobody has begun."""
    dispatch.control_dispatch()
    dispatch.probe_unbegun()


@shared_task(ignore_result=True)
def control_probe(*, sent_at: str) -> None:
    """A probe sent behind unbegun hand-offs: a worker taking it has taken all sent before, so those are lost."""
    dispatch.control_dispatch(passed_before=datetime.fromisoformat(sent_at))


@shared_task(ignore_result=True)
def uploads_collect() -> None:
    """Remove the files of failed and rejected revisions past their retention (beat, hourly)."""
    collect.uploads_collect()


@shared_task(ignore_result=True)
def upload_sessions_collect() -> None:
    """Delete resumable-upload sessions past their expiry, with their stored parts (beat, every 15 minutes)."""
    uploads.upload_sessions_collect()
