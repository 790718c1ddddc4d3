"""The artifact store on a real S3-protocol server (tests/s3.py): upload, validation, export, restore and the
node agent's copy, every byte through django-storages and boto3 over HTTP, as with `MINT_STORAGE=s3`.

The filesystem store has the same paths through the rest of the suite; here each path is checked against
what the S3 server itself holds (read with a client of its own, not through the store).
"""

from __future__ import annotations

import hashlib
import io

import pytest

from adapters import store, tasks
from adapters.models import AdapterRevision
from serving.models import Placement
from serving.tasks import CacheMismatch, fetch_to_node_cache
from tests.adapters.fixtures import uploads_of
from tests.factories import ServingNodeFactory

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def exported(client, payload, *, fmt: str, capture) -> AdapterRevision:
    with capture(execute=True):
        response = client.post(URL, payload, format=fmt)
    assert response.status_code == 201, response.content
    revision = AdapterRevision.objects.get(number=response.json()["number"])
    assert revision.state == "exported", (revision.failure_code, revision.failure_reason)
    return revision


def test_the_store_primitives_work_on_s3(s3_store):
    store.save_file("t/1/a/1/uploads/u/adapter_config.json", io.BytesIO(b"{}"))
    store.save_file("t/1/a/1/uploads/u/deep/w.safetensors", io.BytesIO(b"w" * 3000))
    assert s3_store.keys("t/1/") == ["t/1/a/1/uploads/u/adapter_config.json", "t/1/a/1/uploads/u/deep/w.safetensors"]
    assert store.list_files("t/1/a/1/uploads/u") == s3_store.keys("t/1/")

    # Saving over a file replaces it (no renamed copy beside it).
    store.save_file("t/1/a/1/uploads/u/adapter_config.json", io.BytesIO(b'{"r": 4}'))
    assert len(s3_store.keys("t/1/")) == 2

    # An export is staged, then promoted: the files appear under the final prefix and the staging goes.
    store.save_file("t/1/a/1/r1/.export-x/adapter_model.safetensors", io.BytesIO(b"m" * 10))
    store.promote("t/1/a/1/r1/.export-x", "t/1/a/1/r1/export")
    assert s3_store.keys("t/1/a/1/r1/") == ["t/1/a/1/r1/export/adapter_model.safetensors"]

    store.delete_prefix("t/1/a/1/uploads")
    assert s3_store.keys("t/1/a/1/uploads/") == []


def test_an_upload_is_validated_and_exported_on_s3(
    tenant_a, adapter_a, good_adapter_dir, s3_store, django_capture_on_commit_callbacks
):
    revision = exported(
        tenant_a.client_as("developer"),
        {"files": uploads_of(good_adapter_dir)},
        fmt="multipart",
        capture=django_capture_on_commit_callbacks,
    )

    keys = s3_store.keys(f"{revision.export_uri}/")
    names = {key.rsplit("/", 1)[1] for key in keys}
    assert {"adapter_config.json", "adapter_model.safetensors", "policy_record.json"} <= names
    recorded = {f"{revision.export_uri}/{f['name']}": f["sha256"] for f in revision.policy_record["files"]}
    stored = s3_store.digests(f"{revision.export_uri}/")
    assert {key: stored.get(key) for key in recorded} == recorded
    # The upload itself is in the bucket too (the revision's source), and nothing of it on local disk.
    assert s3_store.keys(revision.source_uri.rstrip("/") + "/")


def test_a_source_uri_in_the_tenants_incoming_area_on_s3(
    tenant_a, adapter_a, good_adapter_dir, s3_store, django_capture_on_commit_callbacks
):
    incoming = f"t/{tenant_a.tenant.id}/incoming/run-7"
    for path in good_adapter_dir.iterdir():
        s3_store.put(f"{incoming}/{path.name}", path)

    revision = exported(
        tenant_a.client_as("key:pipeline"),
        {"source_uri": f"{incoming}/"},
        fmt="json",
        capture=django_capture_on_commit_callbacks,
    )

    assert s3_store.keys(f"{revision.export_uri}/")


def test_a_removed_export_is_restored_identical_on_s3(
    tenant_a, adapter_a, good_adapter_dir, s3_store, django_capture_on_commit_callbacks
):
    revision = exported(
        tenant_a.client_as("developer"),
        {"files": uploads_of(good_adapter_dir)},
        fmt="multipart",
        capture=django_capture_on_commit_callbacks,
    )
    client = s3_store.server.client()
    before = s3_store.digests(f"{revision.export_uri}/")
    for key in before:
        client.delete_object(Bucket=s3_store.bucket, Key=key)
    assert s3_store.keys(f"{revision.export_uri}/") == []

    tasks.revision_export(revision_id=revision.id)

    assert s3_store.digests(f"{revision.export_uri}/") == before
    revision.refresh_from_db()
    assert revision.state == "exported"


def test_the_node_agent_copies_an_export_from_s3_and_checks_it(
    tenant_a, adapter_a, good_adapter_dir, s3_store, tmp_path, django_capture_on_commit_callbacks
):
    revision = exported(
        tenant_a.client_as("developer"),
        {"files": uploads_of(good_adapter_dir)},
        fmt="multipart",
        capture=django_capture_on_commit_callbacks,
    )
    node = ServingNodeFactory(base_model=adapter_a.base_model, cache_dir=str(tmp_path / "node-cache"))
    placement = Placement.objects.create(node=node, revision=revision, state="loading")

    copied = fetch_to_node_cache(placement)

    recorded = {f["name"]: f["sha256"] for f in revision.policy_record["files"] if f["name"] != "policy_record.json"}
    assert {p.name: sha256(p.read_bytes()) for p in copied.iterdir()} == recorded

    # A file changed in the bucket after the export is caught: the copy is refused, nothing is left behind.
    name = next(iter(recorded))
    s3_store.server.client().put_object(Bucket=s3_store.bucket, Key=f"{revision.export_uri}/{name}", Body=b"x")
    elsewhere = ServingNodeFactory(base_model=adapter_a.base_model, cache_dir=str(tmp_path / "other"))
    other = Placement.objects.create(node=elsewhere, revision=revision, state="loading")
    with pytest.raises(CacheMismatch, match="does not match its recorded SHA-256"):
        fetch_to_node_cache(other)
    assert not any((tmp_path / "other").iterdir())
