"""Per-tenant quotas on stored bytes and revisions, and the collection of failed and rejected uploads."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters import collect, selectors, store
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from tenants.models import AuditEvent
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/"


def register(tenant, directory):
    # Equal uploads on purpose: these tests count bytes and revisions (tests/adapters/test_duplicate_uploads.py).
    return tenant.client_as("developer").post(
        URL, {"files": uploads_of(directory), "allow_duplicate": "true"}, format="multipart"
    )


def use_of(tenant) -> selectors.StorageUse:
    """The tenant row's counters, checked against a recount of the catalog."""
    tenant.refresh_from_db()
    use = selectors.storage_use(tenant=tenant)
    assert use == selectors.storage_recount(tenant=tenant)
    return use


def size_of(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_registration_past_the_stored_bytes_quota_is_refused_and_stores_nothing(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        assert register(tenant_a, good_adapter_dir).status_code == 201
    used = use_of(tenant_a.tenant)
    assert used.bytes > size_of(good_adapter_dir)  # the upload and its export
    tenant_a.tenant.max_storage_bytes = used.bytes + size_of(good_adapter_dir) - 1
    tenant_a.tenant.save()
    files_before = sorted(p for p in artifact_root.rglob("*") if p.is_file())

    response = register(tenant_a, good_adapter_dir)

    assert response.status_code == 429
    error = error_of(response)
    assert error["code"] == "storage_quota_exceeded"
    assert f"max_storage_bytes={tenant_a.tenant.max_storage_bytes}" in error["message"]
    assert error["detail"]["stored_bytes"] == used.bytes
    assert AdapterRevision.objects.count() == 1
    assert sorted(p for p in artifact_root.rglob("*") if p.is_file()) == files_before
    assert use_of(tenant_a.tenant) == used


def test_a_registration_past_the_revisions_quota_is_refused(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    tenant_a.tenant.max_revisions = 2
    tenant_a.tenant.save()
    assert register(tenant_a, good_adapter_dir).status_code == 201
    assert register(tenant_a, good_adapter_dir).status_code == 201
    response = register(tenant_a, good_adapter_dir)
    assert response.status_code == 429
    assert error_of(response)["code"] == "storage_quota_exceeded"
    assert "max_revisions=2" in error_of(response)["message"]


def test_quotas_are_per_tenant(tenant_a, tenant_b, adapter_a, adapter_b, good_adapter_dir, artifact_root):
    tenant_a.tenant.max_revisions = 0
    tenant_a.tenant.save()
    assert register(tenant_a, good_adapter_dir).status_code == 429
    response = tenant_b.client_as("developer").post(
        f"/api/v1/adapters/{adapter_b.name}/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
    )
    assert response.status_code == 201


def _failed_upload(tenant, directory, django_capture_on_commit_callbacks) -> AdapterRevision:
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # seen by validation, not at registration
    with django_capture_on_commit_callbacks(execute=True):
        assert register(tenant, directory).status_code == 201
    revision = AdapterRevision.objects.order_by("-id").first()
    assert revision.state == S.FAILED
    return revision


def test_failed_uploads_are_collected_after_the_retention_and_free_the_quota(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, settings, django_capture_on_commit_callbacks
):
    settings.MINT_UPLOAD_RETENTION_DAYS = 7
    failed = _failed_upload(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    upload = artifact_root / failed.source_uri
    assert upload.is_dir()
    before = use_of(tenant_a.tenant)

    assert collect.uploads_collect() == 0  # within the retention: kept (a Retry must find its files)
    assert upload.is_dir()

    assert collect.uploads_collect(now=timezone.now() + timedelta(days=7, seconds=1)) == 1
    failed.refresh_from_db()
    assert not upload.exists()
    assert failed.purged_at is not None
    assert failed.state == S.FAILED and failed.failure_code  # the row and its reason stay
    assert AuditEvent.objects.filter(tenant=tenant_a.tenant, action="revision.purge").count() == 1
    after = use_of(tenant_a.tenant)
    assert (after.bytes, after.revisions) == (before.bytes - failed.size_bytes, before.revisions - 1)
    assert collect.uploads_collect(now=timezone.now() + timedelta(days=30)) == 0  # once only


def test_rejected_revisions_lose_upload_and_export_and_approved_ones_keep_theirs(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, settings, django_capture_on_commit_callbacks
):
    settings.MINT_UPLOAD_RETENTION_DAYS = 0
    with django_capture_on_commit_callbacks(execute=True):
        register(tenant_a, good_adapter_dir)
        register(tenant_a, good_adapter_dir)
    rejected, approved = AdapterRevision.objects.order_by("number")
    AdapterRevision.objects.filter(id=rejected.id).update(state=S.REJECTED)
    AdapterRevision.objects.filter(id=approved.id).update(state=S.APPROVED)

    assert collect.uploads_collect(now=timezone.now() + timedelta(seconds=1)) == 1

    assert not (artifact_root / rejected.source_uri).exists()
    assert not (artifact_root / rejected.export_uri).exists()
    assert (artifact_root / approved.source_uri).is_dir()
    assert (artifact_root / approved.export_uri / "policy_record.json").is_file()


def test_a_tenants_own_incoming_files_are_left_to_the_tenant(tenant_a, adapter_a, artifact_root, settings):
    settings.MINT_UPLOAD_RETENTION_DAYS = 0
    incoming = artifact_root / store.incoming_prefix(tenant_a.tenant.id) / "run-1"
    incoming.mkdir(parents=True)
    (incoming / "adapter_config.json").write_text("{}")
    revision = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=S.FAILED, source_uri=f"{store.incoming_prefix(tenant_a.tenant.id)}/run-1"
    )
    assert collect.uploads_collect(now=timezone.now() + timedelta(seconds=1)) == 1
    assert (incoming / "adapter_config.json").is_file()
    revision.refresh_from_db()
    assert revision.purged_at is not None
