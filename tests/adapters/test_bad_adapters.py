"""The bad-adapter corpus: each case fails with its own named reason and leaves nothing behind."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from adapters.models import AdapterRevision
from tenants.models import AuditEvent
from tests.adapters.corpus import BAD_CASES, make_bad_adapter
from tests.adapters.fixtures import uploads_of

pytestmark = pytest.mark.django_db

# Refused at registration (400, the same code, nothing stored), from the names, the config or a zip's directory
# (adapters/artifacts/precheck.py); the others need validation's reading.
SEEN_AT_REGISTRATION = {
    "pickle_file",
    "missing_config",
    "not_lora",
    "no_tensors",
    "rank_too_high",
    "archive_too_many_files",
}


def _fields(bad) -> dict:
    return {"files": uploads_of(bad)} if bad.is_dir() else {"archive": SimpleUploadedFile(bad.name, bad.read_bytes())}


@pytest.mark.parametrize(("case", "code"), sorted((c, BAD_CASES[c]) for c in SEEN_AT_REGISTRATION))
def test_bad_adapter_seen_at_registration_is_a_400_with_its_reason(
    tenant_a, adapter_a, artifact_root, tmp_path, case, code
):
    bad = make_bad_adapter(case, tmp_path / "bad")
    response = tenant_a.client_as("developer").post(
        "/api/v1/adapters/support-bot/revisions/", _fields(bad), format="multipart"
    )
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == code
    assert len(response.json()["error"]["message"]) > 20
    assert not AdapterRevision.objects.exists()
    assert not [p for p in artifact_root.rglob("*") if p.is_file()]


@pytest.mark.parametrize(("case", "code"), sorted(c for c in BAD_CASES.items() if c[0] not in SEEN_AT_REGISTRATION))
def test_bad_adapter_fails_with_its_reason_and_leaves_nothing_behind(
    tenant_a, adapter_a, artifact_root, tmp_path, case, code, django_capture_on_commit_callbacks
):
    bad = make_bad_adapter(case, tmp_path / "bad")
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", _fields(bad), format="multipart"
        )
    assert response.status_code == 201, response.content

    revision = AdapterRevision.objects.get()
    assert revision.state == "failed"
    assert revision.failure_code == code
    assert len(revision.failure_reason) > 20

    shown = tenant_a.client_as("viewer").get("/api/v1/adapters/support-bot/revisions/1/").json()
    assert (shown["failure"]["code"], shown["failure"]["reason"]) == (code, revision.failure_reason)
    event = AuditEvent.objects.get(action="revision.fail")
    assert event.after["code"] == code and event.after["reason"] == revision.failure_reason

    # Nothing outside the revision's own upload prefix, and no export.
    files = [p.relative_to(artifact_root).as_posix() for p in artifact_root.rglob("*") if p.is_file()]
    assert files and all(f.startswith(revision.source_uri + "/") for f in files), files
    assert not revision.export_uri
