"""Stuck control work has a warning and an end: a revision too long in validation or export is shown as stalled,
and one whose hand-off to the workers was lost is handed over again, then fails (retryably) past the bound."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters import dispatch, services
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from tenants.access import Actor
from tenants.models import AuditEvent

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions"


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    handed: list[int] = []
    monkeypatch.setattr(dispatch, "_send", lambda revision_id, state, **_: handed.append(revision_id))
    return handed


def in_stage(adapter, number: int, state: str, *, minutes: float, dispatched: float | None = None, **fields):
    """A revision that entered `state` that many minutes ago (handed to a worker `dispatched` minutes ago)."""
    now = timezone.now()
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state=state,
        source_uri="x",
        updated_at=now - timedelta(minutes=minutes),
        dispatched_at=None if dispatched is None else now - timedelta(minutes=dispatched),
        **fields,
    )


def test_a_revision_past_the_stale_bound_is_shown_stalled_since_its_stage_began(tenant_a, adapter_a, settings):
    settings.MINT_STAGE_STALE_AFTER_S = 600
    stuck = in_stage(adapter_a, 1, S.REGISTERED, minutes=26)
    in_stage(adapter_a, 2, S.VALIDATED, minutes=3, dispatched=3)
    in_stage(adapter_a, 3, S.FAILED, minutes=60)
    client = tenant_a.client_as("viewer")

    body = client.get(f"{URL}/1/").json()
    assert body["stalled"] is True
    assert body["stalled_since"] == stuck.updated_at.isoformat().replace("+00:00", "Z")
    assert "waits for a control worker" in body["stalled_reason"]
    rows = {r["number"]: r for r in client.get(f"{URL}/").json()["results"]}
    assert (rows[2]["stalled"], rows[2]["stalled_since"], rows[2]["stalled_reason"]) == (False, None, None)
    assert rows[3]["stalled"] is False  # an ended revision is never stalled


def test_a_stalled_handed_over_revision_says_when_it_went_and_what_happens_next(adapter_a, settings):
    settings.MINT_STAGE_STALE_AFTER_S = 60
    revision = in_stage(adapter_a, 1, S.VALIDATED, minutes=5, dispatched=8)
    reason = dispatch.stall_reason(revision)
    assert reason.startswith("Its export was handed to a worker at")
    assert "export_lost, retryable" in reason


def test_a_lost_hand_off_is_handed_over_again_and_counted(
    adapter_a, sent, settings, django_capture_on_commit_callbacks
):
    settings.MINT_STAGE_STALE_AFTER_S = 60
    lost_after = dispatch.lost_after_s() / 60
    revision = in_stage(adapter_a, 1, S.REGISTERED, minutes=lost_after + 5, dispatched=lost_after + 1)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch()
    revision.refresh_from_db()
    assert revision.deliveries == 1
    assert revision.dispatched_at > timezone.now() - timedelta(minutes=1)  # handed over again at once
    assert sent == [revision.id]
    event = AuditEvent.objects.get(action="revision.requeue")
    assert event.after == {"state": "registered", "deliveries": 1, "limit": settings.MINT_TASK_MAX_DELIVERIES}


def test_past_the_delivery_bound_a_lost_revision_fails_retryably(tenant_a, adapter_a, sent, settings):
    settings.MINT_TASK_MAX_DELIVERIES = 2
    lost_after = dispatch.lost_after_s() / 60
    revision = in_stage(adapter_a, 1, S.VALIDATED, minutes=lost_after + 5, dispatched=lost_after + 9, deliveries=2)
    dispatch.control_dispatch()
    revision.refresh_from_db()
    assert revision.state == S.FAILED and revision.failure_code == "export_lost"
    assert "not a problem in the files" in revision.failure_reason
    services.revision_retry(revision=revision, by=Actor(user=tenant_a.users["developer"]))
    assert AdapterRevision.objects.get(id=revision.id).state == S.REGISTERED


def test_work_that_may_still_be_running_or_waits_its_turn_is_left_alone(
    adapter_a, sent, settings, django_capture_on_commit_callbacks
):
    settings.MINT_CONTROL_CONCURRENCY = 1
    lost_after = dispatch.lost_after_s() / 60
    # Handed over long ago, but its export stage began recently: the export task may be running.
    running = in_stage(adapter_a, 1, S.VALIDATED, minutes=1, dispatched=lost_after + 30)
    # Waiting in the queue for hours (the workers are busy): stalled, never failed nor counted.
    waiting = in_stage(adapter_a, 2, S.REGISTERED, minutes=lost_after * 10)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch()
    running.refresh_from_db()
    waiting.refresh_from_db()
    assert (running.state, running.deliveries) == (S.VALIDATED, 0)
    assert (waiting.state, waiting.deliveries, waiting.dispatched_at) == (S.REGISTERED, 0, None)
    assert dispatch.stalled_since(waiting) == waiting.updated_at
    assert sent == []  # the one place is taken by the running export


def test_the_lost_bound_never_undercuts_the_tasks_time_limit(settings):
    from adapters import tasks

    settings.MINT_STAGE_STALE_AFTER_S = 1
    assert dispatch.lost_after_s() >= tasks.revision_validate.time_limit
    settings.MINT_STAGE_STALE_AFTER_S = 10**6
    assert dispatch.lost_after_s() == 10**6
