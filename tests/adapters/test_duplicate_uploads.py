"""An upload equal to a revision the adapter already has is refused (409 duplicate_revision), unless asked for.

"Equal" is the source digest validation records (`AdapterRevision.sha256`): the same file names with the
same contents. Multipart uploads are digested while they stream in and compared before anything is
stored; a `source_uri` is compared when validation digests it, and then fails `duplicate_revision`.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection

from adapters import services
from adapters.artifacts.digest import combined_digest
from adapters.models import Adapter, AdapterRevision
from adapters.pipeline import source_digest
from tenants.access import Actor
from tests.adapters.corpus import TINY_DENSE, make_archive, write_lora_adapter
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/"


def stored(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def upload(client, directory: Path, callbacks, **fields):
    with callbacks(execute=True):
        return client.post(URL, {"files": uploads_of(directory), **fields}, format="multipart")


def test_pressing_upload_three_times_makes_one_revision(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("developer")
    first = upload(client, good_adapter_dir, django_capture_on_commit_callbacks)
    assert first.status_code == 201, first.content
    files_after_first = stored(artifact_root)
    for _ in range(2):
        again = upload(client, good_adapter_dir, django_capture_on_commit_callbacks)
        assert again.status_code == 409, again.content
        error = error_of(again)
        assert error["code"] == "duplicate_revision"
        assert error["detail"]["duplicate_of"] == "r1"
        assert error["detail"]["sha256"] == AdapterRevision.objects.get(number=1).sha256
        assert "r1" in error["message"] and "allow_duplicate" in error["message"]
    assert list(AdapterRevision.objects.values_list("number", flat=True)) == [1]
    assert Adapter.objects.get(id=adapter_a.id).revision_counter == 1
    assert stored(artifact_root) == files_after_first  # the refused uploads left nothing


def test_allow_duplicate_registers_it_anyway(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("key:pipeline")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    again = upload(client, good_adapter_dir, django_capture_on_commit_callbacks, allow_duplicate="true")
    assert again.status_code == 201, again.content
    assert again.json()["revision"] == "r2"
    second = AdapterRevision.objects.get(number=2)
    assert second.state == "exported" and second.allow_duplicate
    assert second.sha256 == AdapterRevision.objects.get(number=1).sha256


def test_the_digest_taken_while_streaming_is_the_one_validation_records(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("developer")
    response = client.post(URL, {"files": uploads_of(good_adapter_dir)}, format="multipart")  # not validated yet
    assert response.status_code == 201
    registered = AdapterRevision.objects.get(number=1)
    assert registered.state == "registered"
    assert registered.sha256 == source_digest(good_adapter_dir)
    assert registered.sha256 == source_digest(artifact_root / registered.source_uri)
    assert response.json()["sha256"] == registered.sha256


def test_a_changed_file_is_not_a_duplicate(
    tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("developer")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    other = write_lora_adapter(tmp_path / "other", TINY_DENSE, rank=4, alpha=8.0, targets=("q_proj", "v_proj"), seed=7)
    assert upload(client, other, django_capture_on_commit_callbacks).status_code == 201
    assert AdapterRevision.objects.count() == 2


def test_a_failed_revision_may_be_uploaded_again(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    """A failure may have been the platform's (a time limit, a lost worker): sending the same bytes is legitimate."""
    client = tenant_a.client_as("developer")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    AdapterRevision.objects.filter(number=1).update(state="failed", failure_code="validation_timeout")
    again = upload(client, good_adapter_dir, django_capture_on_commit_callbacks)
    assert again.status_code == 201, again.content
    assert AdapterRevision.objects.get(number=2).state == "exported"


def test_a_rejected_revision_still_counts(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("developer")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    AdapterRevision.objects.filter(number=1).update(state="rejected")
    again = upload(client, good_adapter_dir, django_capture_on_commit_callbacks)
    assert again.status_code == 409 and error_of(again)["detail"] == {
        "duplicate_of": "r1",
        "state": "rejected",
        "sha256": AdapterRevision.objects.get(number=1).sha256,
    }


def test_the_same_archive_twice_is_refused_at_registration(
    tenant_a, adapter_a, good_adapter_dir, tmp_path, artifact_root, django_capture_on_commit_callbacks
):
    data = make_archive(good_adapter_dir, tmp_path / "adapter.zip", "zip").read_bytes()
    client = tenant_a.client_as("key:pipeline")
    for expected in (201, 409):
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post(URL, {"archive": SimpleUploadedFile("adapter.zip", data)}, format="multipart")
        assert response.status_code == expected, response.content
    assert error_of(response)["detail"]["duplicate_of"] == "r1"


def _stage(artifact_root: Path, tenant_id: int, name: str, source: Path) -> str:
    incoming = artifact_root / f"t/{tenant_id}/incoming/{name}"
    incoming.mkdir(parents=True)
    for file in source.iterdir():
        (incoming / file.name).write_bytes(file.read_bytes())
    return f"t/{tenant_id}/incoming/{name}/"


def test_a_source_uri_duplicate_fails_at_validation_naming_the_original(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("key:pipeline")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    uri = _stage(artifact_root, tenant_a.tenant.id, "run-1", good_adapter_dir)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(URL, {"source_uri": uri}, format="json")
    assert response.status_code == 201, response.content  # registration never reads the store's files
    duplicate = AdapterRevision.objects.get(number=2)
    assert (duplicate.state, duplicate.failure_code, duplicate.duplicate_of) == ("failed", "duplicate_revision", 1)
    assert "r1" in duplicate.failure_reason
    shown = client.get(f"{URL}2/").json()
    assert shown["failure"]["code"] == "duplicate_revision" and shown["failure"]["duplicate_of"] == "r1"


def test_a_source_uri_with_allow_duplicate_is_kept(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("key:pipeline")
    assert upload(client, good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    uri = _stage(artifact_root, tenant_a.tenant.id, "run-1", good_adapter_dir)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(URL, {"source_uri": uri, "allow_duplicate": True}, format="json")
    assert response.status_code == 201, response.content
    assert AdapterRevision.objects.get(number=2).state == "exported"


def test_the_first_of_two_equal_source_uris_is_kept(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("key:pipeline")
    uris = [_stage(artifact_root, tenant_a.tenant.id, f"run-{i}", good_adapter_dir) for i in (1, 2)]
    with django_capture_on_commit_callbacks(execute=True):
        for uri in uris:
            assert client.post(URL, {"source_uri": uri}, format="json").status_code == 201
    states = dict(AdapterRevision.objects.values_list("number", "state"))
    assert states == {1: "exported", 2: "failed"}
    # ... and a multipart upload of the same files now finds r1.
    again = upload(client, good_adapter_dir, django_capture_on_commit_callbacks)
    assert again.status_code == 409 and error_of(again)["detail"]["duplicate_of"] == "r1"


def test_duplicates_are_per_adapter_and_never_cross_tenants(
    tenant_a, tenant_b, adapter_a, adapter_b, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    assert (
        upload(tenant_a.client_as("developer"), good_adapter_dir, django_capture_on_commit_callbacks).status_code == 201
    )
    client_b = tenant_b.client_as("developer")
    with django_capture_on_commit_callbacks(execute=True):
        own = client_b.post(
            f"/api/v1/adapters/{adapter_b.name}/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
        )
    assert own.status_code == 201, own.content  # the same bytes in another tenant's adapter: no 409, no leak
    # Tenant B posting to tenant A's adapter name: the adapter does not exist for B.
    foreign = client_b.post(URL, {"files": uploads_of(good_adapter_dir)}, format="multipart")
    assert foreign.status_code == 404 and "r1" not in foreign.content.decode()


def test_combined_digest_is_the_digest_revisions_always_recorded(tmp_path):
    """The formula validation used before registration digested anything: sorted paths, `name\\0sha\\n` lines."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").write_bytes(b"1")
    (tmp_path / "a.b").write_bytes(b"2")
    recorded = hashlib.sha256()
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        file_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        recorded.update(f"{path.relative_to(tmp_path).as_posix()}\0{file_sha}\n".encode())
    entries = [("a.b", hashlib.sha256(b"2").hexdigest()), ("a/b", hashlib.sha256(b"1").hexdigest())]
    assert combined_digest(entries) == combined_digest(reversed(entries)) == recorded.hexdigest()
    assert source_digest(tmp_path) == recorded.hexdigest()


@pytest.mark.django_db(transaction=True)
def test_two_equal_uploads_at_once_make_one_revision(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def register() -> None:
        files = uploads_of(good_adapter_dir)
        barrier.wait()
        try:
            outcomes.append(services.revision_register(adapter=adapter_a, by=Actor.system(), files=files))
        except services.DuplicateRevision as exc:
            outcomes.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=register) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(type(o).__name__ for o in outcomes) == ["AdapterRevision", "DuplicateRevision"]
    assert AdapterRevision.objects.count() == 1
    uploads = {p.split("/uploads/")[1].split("/")[0] for p in stored(artifact_root) if "/uploads/" in p}
    assert len(uploads) == 1  # the refused one's files were removed


@pytest.mark.parametrize("size", [10, 5 * 1024 * 1024])  # kept in memory, and spooled to a file on disk
def test_each_file_is_digested_as_it_streams_in(rf, size):
    from django.http.multipartparser import MultiPartParser
    from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

    from adapters.apis import UploadParser

    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    body = encode_multipart(BOUNDARY, {"files": [SimpleUploadedFile("a.safetensors", data)]})
    request = rf.generic("POST", URL, body, content_type=MULTIPART_CONTENT)
    UploadParser.prepare_request(request)
    meta = request.META | {"CONTENT_LENGTH": str(len(body))}
    _, parsed = MultiPartParser(meta, request, request.upload_handlers).parse()
    (upload,) = parsed.getlist("files")
    assert upload.sha256 == hashlib.sha256(data).hexdigest()
    assert upload.read() == data
