"""Tasks retry when the artifact store is unreachable and fail the revision only when it stays so."""

from __future__ import annotations

from unittest import mock

import pytest

from adapters import store, tasks
from adapters.models import AdapterRevision
from tests.adapters.fixtures import uploads_of

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _eager_retries():
    # Eager tasks re-run themselves on retry only when exceptions are not propagated to the caller.
    from mint_site.celery import app

    app.conf.task_eager_propagates = False
    yield
    app.conf.task_eager_propagates = True


def register(client, directory):
    return client.post("/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(directory)}, format="multipart")


def test_a_store_outage_is_retried_then_the_revision_proceeds(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    real = store.list_files
    outage = [ConnectionError("store down"), ConnectionError("store down")]

    def flaky(prefix):
        if outage:
            raise outage.pop(0)
        return real(prefix)

    with (
        mock.patch("adapters.store.list_files", side_effect=flaky) as patched,
        django_capture_on_commit_callbacks(execute=True),
    ):
        assert register(tenant_a.client_as("developer"), good_adapter_dir).status_code == 201
    assert patched.call_count >= 3
    assert AdapterRevision.objects.get().state == "exported"


def test_a_store_that_stays_down_fails_the_revision_with_its_reason(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    with (
        mock.patch("adapters.store.list_files", side_effect=ConnectionError("store down")),
        django_capture_on_commit_callbacks(execute=True),
    ):
        assert register(tenant_a.client_as("developer"), good_adapter_dir).status_code == 201
    revision = AdapterRevision.objects.get()
    assert revision.state == "failed"
    assert revision.failure_code == "store_unavailable"
    assert f"{tasks.MAX_RETRIES} retries" in revision.failure_reason


def test_validate_is_idempotent(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        register(tenant_a.client_as("developer"), good_adapter_dir)
    revision = AdapterRevision.objects.get()
    assert revision.state == "exported"
    tasks.revision_validate(revision_id=revision.id)
    tasks.revision_export(revision_id=revision.id)
    tasks.revision_validate(revision_id=999_999)
    revision.refresh_from_db()
    assert revision.state == "exported"
    from tenants.models import AuditEvent

    assert AuditEvent.objects.filter(action="revision.export").count() == 1


def test_demo_adapter_command_writes_a_valid_adapter(dense_base, tmp_path):
    from adapters.artifacts.validate import validate_adapter_dir
    from devtools.demo_adapter import main

    assert main(["--base-model", "test-dense", "--out", str(tmp_path / "a")]) == 0
    checked = validate_adapter_dir(tmp_path / "a", dense_base.spec)
    assert (checked.rank, checked.target_modules) == (8, ["q_proj", "v_proj"])
