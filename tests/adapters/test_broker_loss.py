"""Control work the broker lost is handed over again: soon when no worker began it (once a probe shows the queue
moved past it), only past the hard bound when one did, and never forever (the delivery bound)."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from adapters import dispatch, store, tasks
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from tenants.models import AuditEvent
from tests.adapters.fixtures import uploads_of

pytestmark = pytest.mark.django_db

PICKUP_S = 30.0


@pytest.fixture(autouse=True)
def _pickup(settings):
    settings.MINT_TASK_PICKUP_S = PICKUP_S


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """Hand-offs to the control workers, recorded instead of run."""
    handed: list[int] = []
    monkeypatch.setattr(dispatch, "_send", lambda revision_id, state, **_: handed.append(revision_id))
    return handed


def handed_over(adapter, number: int, state: str = S.REGISTERED, *, ago_s: float, **fields) -> AdapterRevision:
    """A revision handed to the workers `ago_s` seconds ago (its stage began just before)."""
    at = timezone.now() - timedelta(seconds=ago_s)
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state=state,
        source_uri="x",
        updated_at=at - timedelta(seconds=1),
        dispatched_at=at,
        **fields,
    )


def test_a_hand_off_no_worker_began_is_handed_over_again_once_a_probe_passed_it(
    adapter_a, sent, django_capture_on_commit_callbacks
):
    lost = handed_over(adapter_a, 1, ago_s=PICKUP_S + 5)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch(passed_before=timezone.now())
    lost.refresh_from_db()
    assert lost.deliveries == 1
    assert lost.dispatched_at > timezone.now() - timedelta(seconds=5)  # handed over again at once
    assert sent == [lost.id]
    event = AuditEvent.objects.get(action="revision.requeue")
    assert event.after["deliveries"] == 1


def test_an_unbegun_hand_off_waits_out_the_pickup_bound_and_a_probe(adapter_a, sent):
    young = handed_over(adapter_a, 1, ago_s=PICKUP_S - 10)
    old = handed_over(adapter_a, 2, ago_s=PICKUP_S + 5)
    dispatch.control_dispatch()  # no probe came back: the workers may just be down; nothing is counted
    dispatch.control_dispatch(passed_before=timezone.now() - timedelta(seconds=10))  # a probe sent before it
    old.refresh_from_db()
    assert (old.deliveries, AdapterRevision.objects.get(id=young.id).deliveries) == (0, 0)
    dispatch.control_dispatch(passed_before=timezone.now())
    assert AdapterRevision.objects.get(id=old.id).deliveries == 1
    assert AdapterRevision.objects.get(id=young.id).deliveries == 0


def test_a_begun_hand_off_is_not_handed_over_again_before_the_hard_bound(adapter_a, sent):
    lost_after = dispatch.lost_after_s()
    now = timezone.now()
    running = handed_over(adapter_a, 1, ago_s=lost_after + 600, picked_up_at=now - timedelta(seconds=lost_after - 60))
    dispatch.control_dispatch(passed_before=now)
    running.refresh_from_db()
    assert (running.deliveries, running.dispatched_at is not None) == (0, True)
    assert dispatch.begun(running)

    AdapterRevision.objects.filter(id=running.id).update(picked_up_at=now - timedelta(seconds=lost_after + 1))
    dispatch.control_dispatch()
    assert AdapterRevision.objects.get(id=running.id).deliveries == 1


def test_an_export_whose_validation_began_counts_as_unbegun(adapter_a, sent):
    """Validation ended and sent the export (tokenless); its pick-up was the validation's."""
    at = timezone.now() - timedelta(seconds=PICKUP_S + 5)
    revision = AdapterRevision.objects.create(
        adapter=adapter_a,
        number=1,
        state=S.VALIDATED,
        source_uri="x",
        dispatched_at=at - timedelta(seconds=20),
        picked_up_at=at - timedelta(seconds=10),
        updated_at=at,
    )
    assert not dispatch.begun(revision)
    dispatch.control_dispatch(passed_before=timezone.now())
    assert AdapterRevision.objects.get(id=revision.id).deliveries == 1


def test_the_delivery_bound_ends_a_revision_whose_hand_offs_keep_getting_lost(tenant_a, adapter_a, sent, settings):
    settings.MINT_TASK_MAX_DELIVERIES = 2
    revision = handed_over(adapter_a, 1, ago_s=PICKUP_S + 5)
    for deliveries in (1, 2):
        dispatch.control_dispatch(passed_before=timezone.now())
        assert AdapterRevision.objects.get(id=revision.id).deliveries == deliveries
        AdapterRevision.objects.filter(id=revision.id).update(
            dispatched_at=timezone.now() - timedelta(seconds=PICKUP_S + 5)
        )
    dispatch.control_dispatch(passed_before=timezone.now())
    revision.refresh_from_db()
    assert (revision.state, revision.failure_code) == (S.FAILED, "validation_lost")
    assert "the broker lost it" in revision.failure_reason


def test_the_beat_probes_only_behind_hand_offs_that_waited_unbegun(adapter_a, sent):
    with mock.patch.object(tasks.control_probe, "apply_async") as probe:
        handed_over(adapter_a, 1, ago_s=PICKUP_S - 10)
        handed_over(adapter_a, 2, ago_s=PICKUP_S + 600, picked_up_at=timezone.now())
        assert dispatch.probe_unbegun() is False
        handed_over(adapter_a, 3, ago_s=PICKUP_S + 5)
        assert dispatch.probe_unbegun() is True
    (call,) = probe.call_args_list
    assert call.kwargs["expires"] == PICKUP_S
    assert set(call.kwargs["kwargs"]) == {"sent_at"}


def register_lost(tenant, directory, capture) -> AdapterRevision:
    """Register through the API while the broker loses every hand-off."""
    with mock.patch.object(dispatch, "_send"), capture(execute=True):
        response = tenant.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(directory)}, format="multipart"
        )
    assert response.status_code == 201
    return AdapterRevision.objects.get()


def test_a_copy_of_a_superseded_hand_off_does_nothing_and_the_current_one_runs(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    revision = register_lost(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    assert (revision.state, revision.picked_up_at) == (S.REGISTERED, None)
    stale = (revision.dispatched_at - timedelta(minutes=5)).isoformat()
    with django_capture_on_commit_callbacks(execute=True):
        tasks.revision_validate(revision_id=revision.id, handed=stale)
    revision.refresh_from_db()
    assert (revision.state, revision.deliveries, revision.picked_up_at) == (S.REGISTERED, 0, None)

    with django_capture_on_commit_callbacks(execute=True):
        tasks.revision_validate(revision_id=revision.id, handed=revision.dispatched_at.isoformat())
    assert AdapterRevision.objects.get(id=revision.id).state == S.EXPORTED


def test_an_export_sent_before_a_later_hand_off_does_nothing(adapter_a, sent):
    at = timezone.now()
    revision = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=S.VALIDATED, source_uri="x", updated_at=at, dispatched_at=at
    )
    AdapterRevision.objects.filter(id=revision.id).update(dispatched_at=at + timedelta(seconds=1))
    tasks.revision_export(revision_id=revision.id)  # the copy validation sent, superseded
    revision.refresh_from_db()
    assert (revision.state, revision.deliveries, revision.picked_up_at) == (S.VALIDATED, 0, None)


def test_a_revision_whose_hand_off_the_broker_lost_reaches_exported(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    revision = register_lost(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    earlier = timedelta(seconds=PICKUP_S + 5)  # registered and handed over that long before the probe
    AdapterRevision.objects.filter(id=revision.id).update(
        dispatched_at=revision.dispatched_at - earlier, updated_at=revision.updated_at - earlier
    )
    with django_capture_on_commit_callbacks(execute=True):
        tasks.control_probe(sent_at=timezone.now().isoformat())
    revision.refresh_from_db()
    assert revision.state == S.EXPORTED
    assert AuditEvent.objects.filter(action="revision.requeue").count() == 1


# ---------------------------------------------------------------- a rollback's re-export


@pytest.fixture
def removed_export(tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks):
    """An approved revision whose frozen export was removed from the store."""
    import shutil

    with django_capture_on_commit_callbacks(execute=True):
        tenant_a.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
        )
    revision = AdapterRevision.objects.get()
    hour = timedelta(hours=1)  # exported an hour ago
    AdapterRevision.objects.filter(id=revision.id).update(
        state=S.APPROVED,
        dispatched_at=revision.dispatched_at - hour,
        picked_up_at=revision.picked_up_at - hour,
        exported_at=revision.exported_at - hour,
        updated_at=revision.updated_at - hour,
    )
    revision.refresh_from_db()
    shutil.rmtree(artifact_root / revision.export_uri)
    assert not store.export_is_complete(revision)
    return revision


def test_a_lost_re_export_is_sent_again_after_the_pickup_bound_and_restores_the_files(
    removed_export, django_capture_on_commit_callbacks
):
    revision = removed_export
    assert dispatch.export_redrive(revision=revision, asked_at=timezone.now()) == "waiting"
    asked = timezone.now() - timedelta(seconds=PICKUP_S + 1)
    with django_capture_on_commit_callbacks(execute=True):
        assert dispatch.export_redrive(revision=revision, asked_at=asked) == "sent"
    revision.refresh_from_db()
    assert store.export_is_complete(revision)
    assert (revision.deliveries, revision.picked_up_at) == (0, None)  # restored: its deliveries are given back
    assert dispatch.export_redrive(revision=revision, asked_at=asked) == "complete"


def test_a_begun_re_export_is_left_to_run_and_the_bound_ends_a_lost_one(
    removed_export, settings, django_capture_on_commit_callbacks
):
    revision = removed_export
    asked = timezone.now() - timedelta(seconds=PICKUP_S + 1)
    assert dispatch.restore_begin(revision)
    assert not dispatch.restore_begin(AdapterRevision.objects.get(id=revision.id))  # one re-export at a time
    assert dispatch.export_redrive(revision=revision, asked_at=asked) == "running"

    settings.MINT_TASK_MAX_DELIVERIES = 1
    long_ago = timezone.now() - timedelta(seconds=dispatch.lost_after_s() + 1)
    AdapterRevision.objects.filter(id=revision.id).update(picked_up_at=long_ago)
    revision.refresh_from_db()
    with mock.patch.object(tasks.revision_export, "delay") as export:
        with django_capture_on_commit_callbacks(execute=True):
            assert dispatch.export_redrive(revision=revision, asked_at=asked) == "sent"
        revision.refresh_from_db()
        assert revision.deliveries == 1
        AdapterRevision.objects.filter(id=revision.id).update(dispatched_at=asked)
        revision.refresh_from_db()
        assert dispatch.export_redrive(revision=revision, asked_at=asked) == "given_up"
    assert export.call_count == 1
