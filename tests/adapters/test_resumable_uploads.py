"""Resumable uploads (adapters/uploads.py, adapters/upload_apis.py): an archive sent in numbered parts, in any
order, across dropped connections, then registered, validated and exported exactly like a one-shot upload."""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from adapters import tasks, upload_parts, uploads
from adapters.models import AdapterRevision, UploadPart, UploadSession
from tenants.access import Actor
from tenants.models import Tenant
from tests.adapters.corpus import make_archive
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/uploads/"
PART = 1024  # small parts, so a tiny test adapter spans several


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pieces(data: bytes, size: int = PART) -> dict[int, bytes]:
    return {i // size + 1: data[i : i + size] for i in range(0, len(data), size)}


def stored(root: Path, prefix: str) -> list[str]:
    base = root / prefix
    return sorted(p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()) if base.exists() else []


@pytest.fixture(autouse=True)
def _small_parts_and_room(settings, tenant_a):
    settings.MINT_UPLOAD_PART_BYTES = PART
    # A test sends tens of parts at once, far past a plan's write burst (tests/tenants/test_throttles.py).
    Tenant.objects.filter(id=tenant_a.tenant.id).update(api_read_rpm=100_000, api_write_rpm=100_000)


@pytest.fixture
def archive(good_adapter_dir, tmp_path) -> bytes:
    data = make_archive(good_adapter_dir, tmp_path / "adapter.tar.gz", "tar.gz").read_bytes()
    assert len(data) > 3 * PART  # several parts, the last one short
    return data


@pytest.fixture
def client(tenant_a):
    return tenant_a.client_as("key:pipeline")


def open_session(client, data: bytes, *, url: str = URL, **override):
    body = {"size": len(data), "sha256": sha(data), "filename": "adapter.tar.gz"} | override
    return client.post(url, body, format="json")


def put_part(client, session_id: str, number: int, body: bytes, *, checksum: str | None = None, url: str = URL):
    headers = {} if checksum == "" else {"HTTP_X_MINT_PART_SHA256": checksum or sha(body)}
    return client.generic(
        "PUT", f"{url}{session_id}/parts/{number}/", body, content_type="application/octet-stream", **headers
    )


def complete(client, session_id: str, payload: dict | None = None, *, url: str = URL):
    return client.post(f"{url}{session_id}/complete/", payload or {}, format="json")


def send_all(client, session_id: str, data: bytes, numbers=None) -> None:
    parts = pieces(data)
    for number in numbers or parts:
        response = put_part(client, session_id, number, parts[number])
        assert response.status_code == 200, response.content
        assert response.json() == {"part": number, "size": len(parts[number]), "sha256": sha(parts[number])}


# ---------------------------------------------------------------- the whole way


def test_parts_sent_out_of_order_complete_into_an_exported_revision(
    tenant_a, adapter_a, archive, client, artifact_root, django_capture_on_commit_callbacks
):
    response = open_session(client, archive)
    assert response.status_code == 201, response.content
    session = response.json()
    count = -(-len(archive) // PART)
    assert {k: session[k] for k in ("adapter", "size", "sha256", "filename", "part_size", "parts", "received")} == {
        "adapter": "support-bot",
        "size": len(archive),
        "sha256": sha(archive),
        "filename": "adapter.tar.gz",
        "part_size": PART,
        "parts": count,
        "received": [],
    }
    assert session["state"] == "open" and session["expires_at"] > session["created_at"]

    send_all(client, session["id"], archive, numbers=list(range(count, 0, -1)))
    prefix = f"t/{tenant_a.tenant.id}/uploads/"
    assert len(stored(artifact_root, prefix)) == count
    # A filesystem store keeps each part as a file of its own: no multipart upload, no ETags.
    assert UploadSession.objects.get(id=session["id"]).s3_upload_id == ""
    assert set(UploadPart.objects.values_list("s3_etag", flat=True)) == {""}

    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session["id"], {"training_step": 1200})
    assert done.status_code == 201, done.content
    body = done.json()
    assert body["number"] == 1 and body["revision"] == "r1" and body["training_step"] == 1200
    assert body["sha256"] and body["size_bytes"] == len(archive)

    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert revision.state == "exported", (revision.failure_code, revision.failure_reason)
    assert revision.policy_record["training_step"] == 1200
    # The session is done, its parts are gone from the database and the store.
    row = UploadSession.objects.get(id=session["id"])
    assert (row.state, row.revision_id) == ("completed", revision.id)
    assert not UploadPart.objects.filter(session=row).exists()
    assert stored(artifact_root, prefix) == []
    assert client.get(URL).json()["results"] == []
    # Completing again registers nothing more.
    again = complete(client, session["id"])
    assert again.status_code == 409 and error_of(again)["code"] == "upload_not_open"
    assert AdapterRevision.objects.filter(adapter=adapter_a).count() == 1


def test_a_completed_upload_answers_like_a_one_shot_registration(
    tenant_a, adapter_a, archive, client, artifact_root, django_capture_on_commit_callbacks
):
    one_shot = client.post(
        "/api/v1/adapters/support-bot/revisions/",
        {"archive": SimpleUploadedFile("adapter.tar.gz", archive)},
        format="multipart",
    )
    assert one_shot.status_code == 201, one_shot.content
    session = open_session(client, archive).json()
    send_all(client, session["id"], archive)

    # The same archive again: registration's own duplicate check refuses it, and the session stays open.
    refused = complete(client, session["id"])
    assert refused.status_code == 409 and error_of(refused)["code"] == "duplicate_revision"
    assert client.get(f"{URL}{session['id']}/").json()["state"] == "open"

    done = complete(client, session["id"], {"allow_duplicate": True, "parent": "r1"})
    assert done.status_code == 201, done.content
    first, second = one_shot.json(), done.json()
    assert set(first) == set(second)
    assert second["parent"] == "r1" and second["number"] == 2
    same = ("state", "sha256", "size_bytes", "registered_by")
    assert {k: second[k] for k in same} == {k: first[k] for k in same}


def test_an_upload_resumes_from_the_parts_the_session_received(
    tenant_a, adapter_a, archive, client, artifact_root, django_capture_on_commit_callbacks
):
    session = open_session(client, archive).json()
    parts = pieces(archive)
    send_all(client, session["id"], archive, numbers=[1, 3])

    # The connection dropped; the client asks what arrived, and sends only the rest.
    seen = client.get(f"{URL}{session['id']}/").json()
    assert seen["received"] == [1, 3] and seen["state"] == "open"
    listed = client.get(URL).json()["results"]
    assert [(s["id"], s["received"]) for s in listed] == [(session["id"], [1, 3])]
    rest = [n for n in parts if n not in seen["received"]]
    send_all(client, session["id"], archive, numbers=rest)
    assert client.get(f"{URL}{session['id']}/").json()["received"] == sorted(parts)

    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session["id"])
    assert done.status_code == 201, done.content
    assert AdapterRevision.objects.get(adapter=adapter_a, number=1).state == "exported"


def test_the_default_part_size_is_eight_mib(settings, adapter_a, client):
    settings.MINT_UPLOAD_PART_BYTES = 8 * 1024 * 1024
    session = open_session(client, b"", size=20 * 1024 * 1024, sha256="a" * 64).json()
    assert (session["part_size"], session["parts"]) == (8 * 1024 * 1024, 3)
    row = UploadSession.objects.get(id=session["id"])
    assert [row.expected_part_size(n) for n in (1, 2, 3)] == [8 * 1024 * 1024, 8 * 1024 * 1024, 4 * 1024 * 1024]


# ---------------------------------------------------------------- refusals when a session is opened


@pytest.mark.parametrize(
    ("override", "status", "code", "named"),
    [
        ({"size": 0}, 400, "empty_upload", "size"),
        ({"sha256": "not-a-digest"}, 400, "bad_sha256", "sha256"),
        ({"sha256": "ab" * 31}, 400, "bad_sha256", "sha256"),
        ({"filename": "adapter_model.safetensors"}, 400, "bad_filename", "adapter_model.safetensors"),
        ({"filename": "model.pt"}, 400, "bad_filename", "model.pt"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_problem(adapter_a, archive, client, override, status, code, named):
    response = open_session(client, archive, **override)
    assert response.status_code == status, response.content
    error = error_of(response)
    assert error["code"] == code and named in error["message"]
    assert not UploadSession.objects.exists()


def test_a_size_over_the_tenants_upload_limit_is_refused_like_a_one_shot_upload(tenant_a, adapter_a, archive, client):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_upload_bytes=len(archive) - 1)
    response = open_session(client, archive)
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
    assert str(len(archive) - 1) in error_of(response)["message"]
    assert not UploadSession.objects.exists()


def test_open_sessions_are_limited_per_tenant(settings, tenant_a, adapter_a, archive, client):
    settings.MINT_UPLOAD_MAX_OPEN_SESSIONS = 2
    first = open_session(client, archive).json()
    assert open_session(client, archive).status_code == 201
    third = open_session(client, archive)
    assert third.status_code == 429
    assert error_of(third)["code"] == "upload_sessions_exceeded"
    assert error_of(third)["detail"] == {"open_sessions": 2, "limit": 2}
    # An aborted session no longer counts, nor does an expired one.
    assert client.delete(f"{URL}{first['id']}/").status_code == 204
    assert open_session(client, archive).status_code == 201
    UploadSession.objects.filter(state="open").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert open_session(client, archive).status_code == 201


def test_open_sessions_declared_sizes_count_against_the_storage_quota(tenant_a, adapter_a, archive, client):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_storage_bytes=2 * len(archive) + 10)
    assert open_session(client, archive).status_code == 201
    assert open_session(client, archive).status_code == 201
    third = open_session(client, archive)
    assert third.status_code == 429
    assert error_of(third)["code"] == "storage_quota_exceeded"
    assert UploadSession.objects.count() == 2


def test_a_viewer_may_not_open_a_session(tenant_a, adapter_a, archive):
    response = open_session(tenant_a.client_as("viewer"), archive)
    assert response.status_code == 403
    assert not UploadSession.objects.exists()


# ---------------------------------------------------------------- refusals of a part


@pytest.fixture
def session_id(adapter_a, archive, client) -> str:
    return open_session(client, archive).json()["id"]


def assert_nothing_stored(root: Path, tenant_id: int) -> None:
    assert not UploadPart.objects.exists()
    assert stored(root, f"t/{tenant_id}/uploads/") == []


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_part_of_the_wrong_length_is_refused_and_not_stored(
    tenant_a, archive, client, session_id, artifact_root, delta
):
    body = (archive + b"x")[: PART + delta]
    response = put_part(client, session_id, 1, body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "part_size_mismatch" and str(PART) in error["message"]
    assert error["detail"]["expected"] == PART
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)


def test_the_last_part_must_hold_exactly_the_rest(tenant_a, archive, client, session_id, artifact_root):
    last = max(pieces(archive))
    response = put_part(client, session_id, last, archive[(last - 1) * PART :] + b"\0")
    assert response.status_code == 400 and error_of(response)["code"] == "part_size_mismatch"
    assert error_of(response)["detail"]["expected"] == len(archive) - (last - 1) * PART
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)


def test_a_part_not_matching_its_checksum_header_is_refused(tenant_a, archive, client, session_id, artifact_root):
    body = pieces(archive)[1]
    response = put_part(client, session_id, 1, body, checksum=sha(b"something else"))
    assert response.status_code == 400
    assert error_of(response)["code"] == "part_checksum_mismatch"
    assert error_of(response)["detail"]["actual"] == sha(body)
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)


def test_a_part_without_its_checksum_header_is_refused(tenant_a, archive, client, session_id, artifact_root):
    response = put_part(client, session_id, 1, pieces(archive)[1], checksum="")
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "missing_part_checksum" and "X-Mint-Part-Sha256" in error["message"]
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)


@pytest.mark.parametrize("number", [0, "last+1", 999])
def test_an_unknown_part_number_is_refused_naming_it_and_the_count(
    tenant_a, archive, client, session_id, artifact_root, number
):
    count = len(pieces(archive))
    number = count + 1 if number == "last+1" else number
    response = put_part(client, session_id, number, archive[:PART])
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "unknown_part" and error["detail"] == {"part": number, "parts": count}
    assert f"Part {number}" in error["message"] and f"{count} parts" in error["message"]
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)


def test_sending_a_part_again_is_idempotent_and_a_different_one_conflicts(
    tenant_a, archive, client, session_id, artifact_root
):
    body = pieces(archive)[2]
    assert put_part(client, session_id, 2, body).status_code == 200
    again = put_part(client, session_id, 2, body)
    assert again.status_code == 200 and again.json() == {"part": 2, "size": PART, "sha256": sha(body)}
    assert UploadPart.objects.filter(session_id=session_id).count() == 1

    other = bytes(255 - b for b in body)
    conflict = put_part(client, session_id, 2, other)
    assert conflict.status_code == 409
    error = error_of(conflict)
    assert error["code"] == "part_conflict" and error["detail"]["received_sha256"] == sha(body)
    # The part received first is kept, byte for byte.
    [path] = stored(artifact_root, f"t/{tenant_a.tenant.id}/uploads/")
    assert (artifact_root / path).read_bytes() == body


def test_each_part_pushes_the_expiry_back(archive, client, session_id):
    UploadSession.objects.filter(id=session_id).update(expires_at=timezone.now() + timedelta(seconds=60))
    assert put_part(client, session_id, 1, pieces(archive)[1]).status_code == 200
    assert UploadSession.objects.get(id=session_id).expires_at > timezone.now() + timedelta(hours=23)


# ---------------------------------------------------------------- complete and delete


def test_completing_before_every_part_arrived_lists_the_missing_ones(adapter_a, archive, client, session_id):
    count = len(pieces(archive))
    send_all(client, session_id, archive, numbers=[2])
    response = complete(client, session_id)
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "upload_incomplete"
    assert error["detail"]["missing"] == [n for n in range(1, count + 1) if n != 2]
    assert not AdapterRevision.objects.exists()
    assert client.get(f"{URL}{session_id}/").json()["state"] == "open"


def test_a_whole_file_not_matching_its_digest_is_refused_and_its_parts_can_be_sent_again(
    tenant_a, adapter_a, archive, client, session_id, artifact_root, django_capture_on_commit_callbacks
):
    parts = pieces(archive)
    send_all(client, session_id, archive, numbers=[n for n in parts if n != 2])
    damaged = bytes(255 - b for b in parts[2])  # consistent with its own part checksum, wrong for the file
    assert put_part(client, session_id, 2, damaged).status_code == 200

    response = complete(client, session_id)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "upload_checksum_mismatch" and error["detail"]["expected"] == sha(archive)
    assert not AdapterRevision.objects.exists()
    seen = client.get(f"{URL}{session_id}/").json()
    assert (seen["state"], seen["received"]) == ("open", [])
    assert stored(artifact_root, f"t/{tenant_a.tenant.id}/uploads/") == []

    send_all(client, session_id, archive)
    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session_id)
    assert done.status_code == 201, done.content
    assert AdapterRevision.objects.get(adapter=adapter_a).state == "exported"


def test_an_archive_that_is_no_adapter_is_refused_at_complete_and_the_session_stays_open(
    adapter_a, client, artifact_root
):
    junk = b"this is not an archive at all" * 100
    session = open_session(client, junk, filename="adapter.zip").json()
    send_all(client, session["id"], junk)
    response = complete(client, session["id"])
    assert response.status_code == 400, response.content
    assert error_of(response)["code"] != "upload_checksum_mismatch"
    assert not AdapterRevision.objects.exists()
    assert client.get(f"{URL}{session['id']}/").json()["state"] == "open"


def test_deleting_a_session_removes_its_parts(tenant_a, archive, client, session_id, artifact_root):
    send_all(client, session_id, archive, numbers=[1, 2])
    assert len(stored(artifact_root, f"t/{tenant_a.tenant.id}/uploads/")) == 2
    assert client.delete(f"{URL}{session_id}/").status_code == 204
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)
    assert UploadSession.objects.get(id=session_id).state == "aborted"
    assert client.get(URL).json()["results"] == []
    late = put_part(client, session_id, 3, pieces(archive)[3])
    assert late.status_code == 409 and error_of(late)["code"] == "upload_not_open"
    assert_nothing_stored(artifact_root, tenant_a.tenant.id)
    assert complete(client, session_id).status_code == 409


# ---------------------------------------------------------------- garbage collection


def test_expired_sessions_are_collected_with_their_parts(tenant_a, adapter_a, archive, client, artifact_root):
    stale = open_session(client, archive).json()["id"]
    fresh = open_session(client, archive).json()["id"]
    send_all(client, stale, archive, numbers=[1, 2])
    send_all(client, fresh, archive, numbers=[1])
    UploadSession.objects.filter(id=stale).update(expires_at=timezone.now() - timedelta(seconds=1))
    # Expired: as good as gone for the client already.
    assert client.get(f"{URL}{stale}/").status_code == 404

    tasks.upload_sessions_collect()

    assert list(UploadSession.objects.values_list("id", flat=True)) == [UploadSession.objects.get(id=fresh).id]
    assert list(UploadPart.objects.values_list("session_id", "number")) == [(UploadSession.objects.get().id, 1)]
    left = stored(artifact_root, f"t/{tenant_a.tenant.id}/uploads/")
    assert len(left) == 1 and UploadSession.objects.get().id.hex in left[0]
    assert uploads.upload_sessions_collect() == 0


def test_the_collector_runs_on_beat(settings):
    schedule = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "adapters.tasks.upload_sessions_collect" in schedule


# ---------------------------------------------------------------- tenancy


@pytest.fixture
def b_session(tenant_b, adapter_b) -> UploadSession:
    """Tenant B's open session with part 1 received."""
    data = b"b" * (2 * PART)
    session = uploads.upload_session_create(
        adapter=adapter_b, by=Actor(user=tenant_b.users["owner"]), size=len(data), sha256=sha(data), filename="b.tar"
    )
    upload_parts.upload_part_put(session=session, number=1, body=io.BytesIO(data[:PART]), checksum=sha(data[:PART]))
    return session


@pytest.mark.parametrize("via", ["their adapter", "our adapter"])
def test_another_tenants_session_is_not_found_on_every_route(
    tenant_a, adapter_a, b_session, artifact_root, archive, via
):
    client = tenant_a.client_as("owner")
    base = f"/api/v1/adapters/{b_session.adapter.name}/uploads/" if via == "their adapter" else URL
    sid = str(b_session.id)
    answers = {
        "list": client.get(base) if via == "their adapter" else None,
        "detail": client.get(f"{base}{sid}/"),
        "part": put_part(client, sid, 2, b"b" * PART, url=base),
        "complete": complete(client, sid, url=base),
        "delete": client.delete(f"{base}{sid}/"),
        "create": open_session(client, archive, url=base) if via == "their adapter" else None,
    }
    for route, response in answers.items():
        if response is None:
            continue
        assert response.status_code == 404, (route, response.content)
        assert error_of(response) == {"code": "not_found", "message": "Not found."}, route
    if via == "our adapter":
        assert client.get(URL).json()["results"] == []
    # Tenant B's session is untouched.
    b_session.refresh_from_db()
    assert b_session.state == "open" and list(b_session.parts.values_list("number", flat=True)) == [1]
    assert UploadSession.objects.filter(tenant=tenant_a.tenant).count() == 0


def test_a_malformed_session_id_is_not_found(adapter_a, client):
    response = client.get(f"{URL}not-a-uuid/")
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"


# ---------------------------------------------------------------- S3: one multipart upload underneath

MIB = 1024 * 1024
S3_PART = 5 * MIB  # S3's (and moto's) smallest part but the last: the store refuses to assemble shorter ones


@pytest.fixture
def s3_parts(settings, s3_store):
    """The S3 store, with parts of S3's minimum size."""
    settings.MINT_UPLOAD_PART_BYTES = S3_PART
    return s3_store


@pytest.fixture
def big_archive(good_adapter_dir, tmp_path) -> bytes:
    """A valid adapter of about 5.5 MiB (a README of random bytes pads it): two parts, the last one short."""
    (good_adapter_dir / "README.md").write_bytes(os.urandom(S3_PART + MIB // 2))
    data = make_archive(good_adapter_dir, tmp_path / "big.tar.gz", "tar.gz").read_bytes()
    assert S3_PART < len(data) < 2 * S3_PART
    return data


def multipart_uploads(s3_store) -> list[dict]:
    """The multipart uploads open in the test's bucket, read from the server itself."""
    return s3_store.server.client().list_multipart_uploads(Bucket=s3_store.bucket).get("Uploads", [])


def s3_parts_of(s3_store, upload: dict) -> dict[int, str]:
    listed = s3_store.server.client().list_parts(Bucket=s3_store.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return {part["PartNumber"]: part["ETag"] for part in listed.get("Parts", [])}


def send_big(client, session_id: str, data: bytes, numbers=None) -> None:
    parts = pieces(data, S3_PART)
    for number in numbers or parts:
        response = put_part(client, session_id, number, parts[number])
        assert response.status_code == 200, response.content
        assert response.json() == {"part": number, "size": len(parts[number]), "sha256": sha(parts[number])}


def test_on_the_s3_store_the_parts_go_to_one_multipart_upload_and_complete_into_an_exported_revision(
    tenant_a, adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    session = open_session(client, big_archive).json()
    assert (session["part_size"], session["parts"]) == (S3_PART, 2)
    row = UploadSession.objects.get(id=session["id"])
    prefix = f"t/{tenant_a.tenant.id}/uploads/{row.id.hex}/"
    [upload] = multipart_uploads(s3_parts)
    assert (upload["Key"], upload["UploadId"]) == (f"{prefix}whole", row.s3_upload_id)

    send_big(client, session["id"], big_archive, numbers=[2, 1])
    held = s3_parts_of(s3_parts, upload)
    assert sorted(held) == [1, 2]
    assert held == dict(UploadPart.objects.filter(session=row).values_list("number", "s3_etag"))
    assert s3_parts.keys(prefix) == []  # parts of a multipart upload, not objects of their own
    assert [u["UploadId"] for u in multipart_uploads(s3_parts)] == [row.s3_upload_id]

    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session["id"], {"training_step": 7})
    assert done.status_code == 201, done.content
    assert done.json()["size_bytes"] == len(big_archive) and done.json()["sha256"]
    revision = AdapterRevision.objects.get(adapter=adapter_a, number=1)
    assert revision.state == "exported", (revision.failure_code, revision.failure_reason)
    assert multipart_uploads(s3_parts) == []
    assert s3_parts.keys(prefix) == []  # the assembled object is gone: the revision has its own copy
    source = s3_parts.keys(revision.source_uri.rstrip("/") + "/")
    assert sha(
        b"".join(s3_parts.server.client().get_object(Bucket=s3_parts.bucket, Key=k)["Body"].read() for k in source)
    ) == sha(big_archive)
    assert s3_parts.keys(f"{revision.export_uri}/")
    assert not UploadPart.objects.filter(session=row).exists()


def test_an_identical_part_sent_again_on_s3_is_idempotent_and_a_different_one_conflicts(
    adapter_a, big_archive, client, s3_parts
):
    session_id = open_session(client, big_archive).json()["id"]
    body = pieces(big_archive, S3_PART)[1]
    assert put_part(client, session_id, 1, body).status_code == 200
    [upload] = multipart_uploads(s3_parts)
    first = s3_parts_of(s3_parts, upload)
    again = put_part(client, session_id, 1, body)
    assert again.status_code == 200 and again.json() == {"part": 1, "size": S3_PART, "sha256": sha(body)}
    assert UploadPart.objects.filter(session_id=session_id).count() == 1
    assert s3_parts_of(s3_parts, upload) == first

    other = put_part(client, session_id, 1, bytes(255 - b for b in body))
    assert other.status_code == 409 and error_of(other)["code"] == "part_conflict"
    assert s3_parts_of(s3_parts, upload) == first == {1: UploadPart.objects.get(session_id=session_id).s3_etag}


def test_deleting_an_s3_session_aborts_its_multipart_upload(adapter_a, big_archive, client, s3_parts):
    session_id = open_session(client, big_archive).json()["id"]
    send_big(client, session_id, big_archive, numbers=[1])
    assert len(multipart_uploads(s3_parts)) == 1
    assert client.delete(f"{URL}{session_id}/").status_code == 204
    assert multipart_uploads(s3_parts) == []
    assert UploadSession.objects.get(id=session_id).state == "aborted"
    assert not UploadPart.objects.exists() and s3_parts.keys() == []
    assert client.delete(f"{URL}{session_id}/").status_code == 204  # again: the upload is already gone


def test_collecting_expired_s3_sessions_aborts_their_multipart_uploads(adapter_a, big_archive, client, s3_parts):
    stale = open_session(client, big_archive).json()["id"]
    fresh = open_session(client, big_archive).json()["id"]
    send_big(client, stale, big_archive, numbers=[1])
    UploadSession.objects.filter(id=stale).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert uploads.upload_sessions_collect() == 1

    assert [u["UploadId"] for u in multipart_uploads(s3_parts)] == [UploadSession.objects.get(id=fresh).s3_upload_id]
    assert not UploadSession.objects.filter(id=stale).exists() and not UploadPart.objects.exists()


def test_an_s3_part_replaced_by_other_bytes_is_asked_for_again_at_complete(
    adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    # Two senders of part 1 at once: the loser's different bytes reached S3 after the winner's were recorded.
    session_id = open_session(client, big_archive).json()["id"]
    send_big(client, session_id, big_archive)
    [upload] = multipart_uploads(s3_parts)
    s3_parts.server.client().upload_part(
        Bucket=s3_parts.bucket, Key=upload["Key"], UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * S3_PART
    )

    response = complete(client, session_id)
    assert response.status_code == 409, response.content
    assert error_of(response)["code"] == "upload_incomplete" and error_of(response)["detail"]["missing"] == [1]
    assert client.get(f"{URL}{session_id}/").json()["received"] == [2]

    send_big(client, session_id, big_archive, numbers=[1])
    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session_id)
    assert done.status_code == 201, done.content
    assert AdapterRevision.objects.get(adapter=adapter_a).state == "exported"


def test_a_multipart_upload_s3_lost_is_started_again_and_its_parts_asked_for(
    adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    # E.g. a bucket lifecycle rule that aborts incomplete multipart uploads after a day.
    session_id = open_session(client, big_archive).json()["id"]
    send_big(client, session_id, big_archive)
    lost = UploadSession.objects.get(id=session_id).s3_upload_id
    s3_parts.server.client().abort_multipart_upload(
        Bucket=s3_parts.bucket, Key=multipart_uploads(s3_parts)[0]["Key"], UploadId=lost
    )

    response = complete(client, session_id)
    assert response.status_code == 409 and error_of(response)["detail"]["missing"] == [1, 2]
    row = UploadSession.objects.get(id=session_id)
    assert row.s3_upload_id not in ("", lost) and not UploadPart.objects.exists()
    assert [u["UploadId"] for u in multipart_uploads(s3_parts)] == [row.s3_upload_id]

    send_big(client, session_id, big_archive)
    with django_capture_on_commit_callbacks(execute=True):
        assert complete(client, session_id).status_code == 201


def test_a_refused_registration_on_s3_keeps_the_assembled_file_for_the_next_complete(
    adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    one_shot = client.post(
        "/api/v1/adapters/support-bot/revisions/",
        {"archive": SimpleUploadedFile("adapter.tar.gz", big_archive)},
        format="multipart",
    )
    assert one_shot.status_code == 201, one_shot.content
    session_id = open_session(client, big_archive).json()["id"]
    send_big(client, session_id, big_archive)

    refused = complete(client, session_id)
    assert refused.status_code == 409 and error_of(refused)["code"] == "duplicate_revision"
    seen = client.get(f"{URL}{session_id}/").json()
    assert (seen["state"], seen["received"]) == ("open", [1, 2])
    assert multipart_uploads(s3_parts) == []  # assembled: S3 holds the one object now
    again = put_part(client, session_id, 2, pieces(big_archive, S3_PART)[2])
    assert again.status_code == 200  # still idempotent

    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session_id, {"allow_duplicate": True})
    assert done.status_code == 201, done.content
    assert done.json()["sha256"] == one_shot.json()["sha256"]
    assert s3_parts.keys(f"t/{adapter_a.tenant_id}/uploads/{uuid.UUID(session_id).hex}/") == []


def test_an_assembled_file_s3_lost_is_asked_for_again(
    adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    session_id = open_session(client, big_archive).json()["id"]
    send_big(client, session_id, big_archive)
    UploadSession.objects.filter(id=session_id).update(completing_since=timezone.now())  # one `complete` at it
    row = UploadSession.objects.get(id=session_id)
    [upload] = multipart_uploads(s3_parts)
    # It assembled the parts and died; then the assembled object was removed behind its back.
    client_s3 = s3_parts.server.client()
    etags = s3_parts_of(s3_parts, upload)
    client_s3.complete_multipart_upload(
        Bucket=s3_parts.bucket,
        Key=upload["Key"],
        UploadId=row.s3_upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in sorted(etags.items())]},
    )
    UploadSession.objects.filter(id=session_id).update(s3_upload_id="", completing_since=None)
    client_s3.delete_object(Bucket=s3_parts.bucket, Key=upload["Key"])

    response = complete(client, session_id)
    assert response.status_code == 409 and error_of(response)["detail"]["missing"] == [1, 2]
    assert UploadSession.objects.get(id=session_id).s3_upload_id and not UploadPart.objects.exists()
    send_big(client, session_id, big_archive)
    with django_capture_on_commit_callbacks(execute=True):
        assert complete(client, session_id).status_code == 201


def test_a_collection_that_cannot_reach_s3_keeps_the_session_for_the_next_run(
    settings, adapter_a, big_archive, client, s3_parts
):
    session_id = open_session(client, big_archive).json()["id"]
    UploadSession.objects.filter(id=session_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    working = settings.STORAGES
    broken = working["artifacts"] | {
        "OPTIONS": working["artifacts"]["OPTIONS"] | {"bucket_name": "mint-no-such-bucket"}
    }
    settings.STORAGES = working | {"artifacts": broken}
    assert uploads.upload_sessions_collect() == 0
    assert UploadSession.objects.filter(id=session_id).exists() and len(multipart_uploads(s3_parts)) == 1

    settings.STORAGES = working
    assert uploads.upload_sessions_collect() == 1
    assert multipart_uploads(s3_parts) == [] and not UploadSession.objects.exists()


def test_a_whole_file_not_matching_its_digest_on_s3_starts_a_new_multipart_upload(
    adapter_a, big_archive, client, s3_parts, django_capture_on_commit_callbacks
):
    session_id = open_session(client, big_archive).json()["id"]
    before = UploadSession.objects.get(id=session_id).s3_upload_id
    parts = pieces(big_archive, S3_PART)
    send_big(client, session_id, big_archive, numbers=[1])
    damaged = bytes(255 - b for b in parts[2])  # consistent with its own part checksum, wrong for the file
    assert put_part(client, session_id, 2, damaged).status_code == 200

    response = complete(client, session_id)
    assert response.status_code == 400 and error_of(response)["code"] == "upload_checksum_mismatch"
    row = UploadSession.objects.get(id=session_id)
    assert row.state == "open" and row.s3_upload_id not in ("", before) and not UploadPart.objects.exists()
    assert [u["UploadId"] for u in multipart_uploads(s3_parts)] == [row.s3_upload_id]
    assert s3_parts.keys(f"t/{adapter_a.tenant_id}/uploads/") == []

    send_big(client, session_id, big_archive)
    with django_capture_on_commit_callbacks(execute=True):
        done = complete(client, session_id)
    assert done.status_code == 201, done.content
    assert AdapterRevision.objects.get(adapter=adapter_a).state == "exported"


def test_an_s3_store_failure_is_a_503_that_leaves_no_half_written_session(
    settings, adapter_a, big_archive, client, s3_parts
):
    session_id = open_session(client, big_archive).json()["id"]
    working = settings.STORAGES
    broken = working["artifacts"] | {
        "OPTIONS": working["artifacts"]["OPTIONS"] | {"bucket_name": "mint-no-such-bucket"}
    }
    settings.STORAGES = working | {"artifacts": broken}

    refused = open_session(client, big_archive)
    assert refused.status_code == 503, refused.content
    assert error_of(refused)["code"] == "s3_store_unavailable" and "S3" in error_of(refused)["message"]
    assert UploadSession.objects.count() == 1
    part = put_part(client, session_id, 1, pieces(big_archive, S3_PART)[1])
    assert part.status_code == 503 and error_of(part)["code"] == "s3_store_unavailable"
    assert not UploadPart.objects.exists()

    settings.STORAGES = working  # the store is back: the same request now succeeds
    send_big(client, session_id, big_archive, numbers=[1])
    assert len(s3_parts_of(s3_parts, multipart_uploads(s3_parts)[0])) == 1


# ---------------------------------------------------------------- the ASGI body limit (mint_site/limits.py)


@pytest.mark.django_db(transaction=True)
def test_parts_up_to_part_size_pass_the_asgi_body_limit_and_longer_ones_are_refused_unread(
    tenant_a, adapter_a, artifact_root, settings
):
    from tests.mint_site.test_body_limits import call

    # Parts are larger than any other non-upload body may be: the part route has a bound of its own.
    settings.MINT_UPLOAD_PART_BYTES = 200_000
    settings.MINT_MAX_REQUEST_BYTES = 100_000
    data = bytes(range(256)) * 1000  # 256,000 bytes: a full part and a short one
    session = uploads.upload_session_create(
        adapter=adapter_a, by=Actor(user=tenant_a.users["owner"]), size=len(data), sha256=sha(data), filename="a.tar"
    )
    _, token = tenant_a.key("pipeline")
    path = f"{URL}{session.id}/parts/1/"
    headers = {
        "authorization": f"Bearer {token}",
        "content-type": "application/octet-stream",
        "x-mint-part-sha256": sha(data[:200_000]),
    }
    accepted = call("PUT", path, headers, chunks=[data[:100_000], data[100_000:200_000]])
    assert accepted.status == 200, accepted.body
    assert UploadPart.objects.filter(session=session, number=1, size=200_000).exists()

    longer = call("PUT", f"{URL}{session.id}/parts/2/", headers, size=200_001)
    assert (longer.status, longer.error()["code"], longer.chunks_read) == (400, "part_size_mismatch", 0)
    # Every other route keeps MINT_MAX_REQUEST_BYTES.
    other = call("POST", f"{URL}{session.id}/complete/", {"content-type": "application/json"}, size=150_000)
    assert (other.status, other.error()["code"]) == (413, "payload_too_large")


def test_the_list_costs_the_same_queries_for_one_session_or_many(
    settings, adapter_a, archive, client, django_assert_max_num_queries
):
    settings.MINT_UPLOAD_MAX_OPEN_SESSIONS = 10
    first = open_session(client, archive).json()
    send_all(client, first["id"], archive, numbers=[1])
    with django_assert_max_num_queries(50) as one:
        assert len(client.get(URL).json()["results"]) == 1
    queries = len(one)  # now: each request clears the connection's query log
    assert queries > 0
    for _ in range(3):
        send_all(client, open_session(client, archive).json()["id"], archive, numbers=[1, 2])
    with django_assert_max_num_queries(queries):
        listed = client.get(URL).json()["results"]
    assert len(listed) == 4 and listed[-1]["id"] == first["id"]  # newest first


def test_a_session_being_completed_is_not_completed_twice_deleted_or_collected(
    adapter_a, archive, client, session_id, artifact_root
):
    send_all(client, session_id, archive)
    # Another request is assembling and registering it right now.
    UploadSession.objects.filter(id=session_id).update(completing_since=timezone.now())
    second = complete(client, session_id)
    assert second.status_code == 409 and error_of(second)["code"] == "upload_completing"
    deleted = client.delete(f"{URL}{session_id}/")
    assert deleted.status_code == 409 and error_of(deleted)["code"] == "upload_completing"
    UploadSession.objects.filter(id=session_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert uploads.upload_sessions_collect() == 0
    assert UploadPart.objects.filter(session_id=session_id).count() == len(pieces(archive))
    assert not AdapterRevision.objects.exists()

    # A claim left by a request that died is taken over once it is stale.
    stale = timezone.now() - timedelta(seconds=uploads.COMPLETE_CLAIM_S + 1)
    UploadSession.objects.filter(id=session_id).update(
        completing_since=stale, expires_at=timezone.now() + timedelta(hours=1)
    )
    assert complete(client, session_id).status_code == 201
