"""The control queue is fair across tenants, bounded per tenant, and ends poison tasks after bounded deliveries."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest

from adapters import dispatch, services, tasks
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from adapters.services.transitions import revision_delivery_returned, revision_delivery_start
from tests.adapters.fixtures import uploads_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """Hand-offs to the workers, recorded instead of run: the test plays the workers."""
    handed: list[int] = []
    monkeypatch.setattr(dispatch, "_send", lambda revision_id, state, **_: handed.append(revision_id))
    return handed


def queue(adapter, count: int) -> list[AdapterRevision]:
    first = adapter.revisions.count() + 1
    return [
        AdapterRevision.objects.create(adapter=adapter, number=first + i, source_uri=f"src/{first + i}")
        for i in range(count)
    ]


def finish(revision: AdapterRevision) -> None:
    """A worker finished with it: it left the queue (here: failed), which frees its place."""
    services.revision_fail(revision=revision, code="test", reason="done")


def test_one_tenants_burst_does_not_hold_the_other_tenants_revision_back(
    adapter_a, adapter_b, sent, settings, django_capture_on_commit_callbacks
):
    settings.MINT_CONTROL_CONCURRENCY = 2
    burst = queue(adapter_a, 20)
    (victim,) = queue(adapter_b, 1)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch()
    # Tenant A may run one at a time (its plan's max_concurrent_tasks): B's revision goes at once.
    assert sent == [burst[0].id, victim.id]


def test_a_freed_place_goes_to_the_tenant_with_least_running(
    adapter_a, adapter_b, sent, settings, django_capture_on_commit_callbacks
):
    settings.MINT_CONTROL_CONCURRENCY = 2
    for world in (adapter_a, adapter_b):
        world.tenant.max_concurrent_tasks = 2
        world.tenant.save()
    burst = queue(adapter_a, 5)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch()
    assert sent == [burst[0].id, burst[1].id]  # nobody else waits: A may use both places
    (victim,) = queue(adapter_b, 1)
    with django_capture_on_commit_callbacks(execute=True):
        finish(AdapterRevision.objects.get(id=burst[0].id))  # frees a place and dispatches
    assert sent[-1] == victim.id  # B has nothing running, A has one: B first, whatever A queued earlier


def test_nothing_is_handed_over_past_the_control_concurrency(
    adapter_a, adapter_b, sent, settings, django_capture_on_commit_callbacks
):
    settings.MINT_CONTROL_CONCURRENCY = 1
    queue(adapter_a, 3)
    queue(adapter_b, 3)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.control_dispatch()
        dispatch.control_dispatch()  # again: still one in flight
    assert len(sent) == 1
    assert AdapterRevision.objects.filter(dispatched_at__isnull=False).count() == 1


def test_a_suspended_tenants_revisions_wait(adapter_a, sent):
    queue(adapter_a, 1)
    adapter_a.tenant.is_active = False
    adapter_a.tenant.save()
    assert dispatch.control_dispatch() == []


def test_registration_goes_through_the_queue_and_reaches_exported(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
        )
    assert response.status_code == 201
    revision = AdapterRevision.objects.get()
    assert revision.state == S.EXPORTED
    assert revision.dispatched_at is not None
    assert revision.deliveries == 0  # each finished stage gives its deliveries back
    assert revision.export_bytes == sum(f["size_bytes"] for f in revision.policy_record["files"])


def test_each_delivery_is_counted_and_one_past_the_bound_fails_the_revision(adapter_a, settings):
    settings.MINT_TASK_MAX_DELIVERIES = 3
    (revision,) = queue(adapter_a, 1)
    # Three deliveries started and never came back (their worker was killed mid-task).
    for expected in (1, 2, 3):
        assert revision_delivery_start(revision=revision, stage="validation")
        assert AdapterRevision.objects.get(id=revision.id).deliveries == expected
    tasks.revision_validate(revision_id=revision.id)  # the fourth
    revision.refresh_from_db()
    assert revision.state == S.FAILED
    assert revision.failure_code == "validation_resources"
    assert "started 3 times and never finished" in revision.failure_reason


def test_export_deliveries_are_bounded_too(adapter_a, settings):
    settings.MINT_TASK_MAX_DELIVERIES = 1
    (revision,) = queue(adapter_a, 1)
    AdapterRevision.objects.filter(id=revision.id).update(state=S.VALIDATED, deliveries=1)
    tasks.revision_export(revision_id=revision.id)
    revision.refresh_from_db()
    assert (revision.state, revision.failure_code) == (S.FAILED, "export_resources")


def register_with(tenant, directory, capture, validate=None) -> AdapterRevision:
    """Register `directory` (validation replaced by `validate`, if given) and run its tasks; the new revision."""
    patch = mock.patch("adapters.pipeline.validate_adapter_dir", side_effect=validate) if validate else nullcontext()
    with patch, capture(execute=True):
        tenant.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(directory)}, format="multipart"
        )
    return AdapterRevision.objects.order_by("-id").first()


def test_a_validation_past_its_time_limit_fails_with_its_own_code(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, settings, django_capture_on_commit_callbacks
):
    settings.MINT_TASK_SOFT_TIME_LIMIT_S = 0.5
    settings.MINT_TASK_TIME_LIMIT_S = 1.0

    def endless(*args, **kwargs):
        while True:
            pass

    revision = register_with(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks, endless)
    assert (revision.state, revision.failure_code) == (S.FAILED, "validation_timeout")
    assert "MINT_TASK_SOFT_TIME_LIMIT_S" in revision.failure_reason


def test_a_validation_that_runs_out_of_memory_fails_with_its_own_code_and_the_worker_lives(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, settings, django_capture_on_commit_callbacks
):
    settings.MINT_TASK_MEMORY_MB = 128

    def greedy(*args, **kwargs):
        return bytearray(1024 * 1024 * 1024)

    revision = register_with(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks, greedy)
    assert (revision.state, revision.failure_code) == (S.FAILED, "validation_resources")
    # This process ran the task: it still works, and the next revision goes through.
    assert register_with(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks).state == S.EXPORTED


def test_a_retry_after_a_store_outage_gives_its_delivery_back(adapter_a):
    (revision,) = queue(adapter_a, 1)
    revision_delivery_start(revision=revision, stage="validation")
    revision_delivery_returned(revision=revision)
    assert AdapterRevision.objects.get(id=revision.id).deliveries == 0
