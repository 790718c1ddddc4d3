"""Request bodies are refused at the ASGI layer, before Django reads (and spools to disk) a byte of them.

Each request goes through the real ASGI application (mint_site.asgi) with a `receive` that
counts the body chunks it hands out, so "refused before reading" is observed, not assumed.
The upload gate resolves callers in a worker thread: these tests commit their data.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field

import pytest
from asgiref.sync import async_to_sync
from django.contrib.sessions.backends.db import SessionStore
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http.multipartparser import MultiPartParser
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

from adapters.models import AdapterRevision
from tenants.auth import SESSION_TENANT_KEY
from tests.adapters.corpus import lora_config
from tests.conftest import error_of

pytestmark = pytest.mark.django_db(transaction=True)

UPLOAD = "/api/v1/adapters/support-bot/revisions/"
CHUNK = 64 * 1024


@dataclass
class Answer:
    status: int
    body: bytes
    chunks_read: int
    headers: dict[str, str] = field(default_factory=dict)

    def error(self) -> dict:
        return json.loads(self.body)["error"]


async def _call(method: str, path: str, headers: dict[str, str], chunks: list[bytes], declared: bool) -> Answer:
    from mint_site.asgi import application

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if declared:
        raw_headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *raw_headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    pending = list(chunks)
    read = 0
    sent: list[dict] = []

    async def receive():
        nonlocal read
        if not pending:
            await asyncio.sleep(3600)  # the client waits for an answer
        read += 1
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(application(scope, receive, send), timeout=60)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers_out = {k.decode(): v.decode() for k, v in start["headers"]}
    return Answer(start["status"], body, read, headers_out)


def call(method, path, headers=None, *, size=0, chunks=None, declared=True) -> Answer:
    if chunks is None:
        chunks = [b"x" * min(CHUNK, size - i) for i in range(0, size, CHUNK)] or [b""]
    return async_to_sync(_call)(method, path, headers or {}, chunks, declared)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "content-type": "multipart/form-data; boundary=x"}


def test_an_ordinary_route_refuses_a_body_over_the_request_limit_unread(tenant_a, settings):
    settings.MINT_MAX_REQUEST_BYTES = 100_000
    _, token = tenant_a.key("pipeline")  # without one, MINT_ANON_MAX_REQUEST_BYTES binds first (test_preauth.py)
    headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    answer = call("POST", "/api/v1/adapters/", headers, size=200_000)
    assert answer.status == 413
    assert answer.error()["code"] == "payload_too_large"
    assert "MINT_MAX_REQUEST_BYTES" in answer.error()["message"]
    assert answer.chunks_read == 0


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(tenant_a, settings):
    settings.MINT_MAX_REQUEST_BYTES = 100_000
    form = {"content-type": "application/x-www-form-urlencoded"}
    answer = call("POST", "/login/", form, size=10_000_000, declared=False)
    assert answer.status == 413
    assert answer.chunks_read <= 100_000 // CHUNK + 1  # of 153


def test_an_anonymous_upload_is_refused_before_its_body_is_read(tenant_a, adapter_a):
    answer = call("POST", UPLOAD, {"content-type": "multipart/form-data; boundary=x"}, size=1_000_000)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "not_authenticated", 0)


def test_an_upload_with_a_bad_key_is_refused_before_its_body_is_read(tenant_a, adapter_a):
    answer = call("POST", UPLOAD, bearer("mint_000000000000_not-a-secret"), size=1_000_000)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "invalid_api_key", 0)


def test_an_upload_by_a_key_that_may_not_register_is_refused_unread(tenant_a, adapter_a):
    _, token = tenant_a.key("inference")
    answer = call("POST", UPLOAD, bearer(token), size=1_000_000)
    assert (answer.status, answer.chunks_read) == (403, 0)


def test_an_upload_over_the_tenants_limit_is_refused_from_its_length(tenant_a, adapter_a):
    tenant_a.tenant.max_upload_bytes = 500_000
    tenant_a.tenant.save()
    _, token = tenant_a.key("pipeline")
    answer = call("POST", UPLOAD, bearer(token), size=1_000_000)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (413, "payload_too_large", 0)
    assert "500000" in answer.error()["message"]


def test_a_chunked_upload_over_the_tenants_limit_is_cut_off(tenant_a, adapter_a):
    tenant_a.tenant.max_upload_bytes = 500_000
    tenant_a.tenant.save()
    _, token = tenant_a.key("pipeline")
    answer = call("POST", UPLOAD, bearer(token), size=5_000_000, declared=False)
    assert (answer.status, answer.error()["code"]) == (413, "payload_too_large")
    assert answer.chunks_read <= (500_000 + 64 * 1024) // CHUNK + 1  # of 77
    assert AdapterRevision.objects.count() == 0


def test_the_platform_upload_limit_applies_before_anyone_is_resolved(tenant_a, adapter_a, settings):
    settings.MINT_MAX_UPLOAD_BYTES = 100_000
    answer = call("POST", UPLOAD, {"content-type": "multipart/form-data; boundary=x"}, size=200_000)
    assert (answer.status, answer.chunks_read) == (413, 0)


@pytest.mark.parametrize(
    ("quota", "size"),
    [({"max_storage_bytes": 100_000}, 1_000_000), ({"max_revisions": 0}, 1000)],
    ids=["bytes", "revisions"],
)
def test_an_upload_past_the_storage_quota_is_refused_unread(tenant_a, adapter_a, quota, size):
    for name, value in quota.items():
        setattr(tenant_a.tenant, name, value)
    tenant_a.tenant.save()
    _, token = tenant_a.key("pipeline")
    answer = call("POST", UPLOAD, bearer(token), size=size)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (429, "storage_quota_exceeded", 0)
    assert next(iter(quota)) in answer.error()["message"]


def test_uploads_count_against_the_write_rate_before_their_bodies_are_read(tenant_a, adapter_a):
    tenant_a.tenant.api_write_rpm = 2
    tenant_a.tenant.max_upload_bytes = 500_000
    tenant_a.tenant.save()
    _, token = tenant_a.key("pipeline")
    refused = [call("POST", UPLOAD, bearer(token), size=1_000_000) for _ in range(3)]
    assert [a.status for a in refused] == [413, 413, 429]
    assert refused[2].error()["code"] == "rate_limited"
    assert "api_write_rpm" in refused[2].error()["message"]
    assert int(refused[2].headers["retry-after"]) >= 1
    assert [a.chunks_read for a in refused] == [0, 0, 0]


def test_an_upload_counted_at_the_gate_is_not_counted_again(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    tenant_a.tenant.api_write_rpm = 1
    tenant_a.tenant.save()
    _, token = tenant_a.key("pipeline")
    files = [SimpleUploadedFile(p.name, p.read_bytes()) for p in sorted(good_adapter_dir.iterdir())]
    body = encode_multipart(BOUNDARY, {"files": files})
    headers = {"authorization": f"Bearer {token}", "content-type": MULTIPART_CONTENT}
    assert call("POST", UPLOAD, headers, chunks=[body]).status == 201
    assert call("POST", UPLOAD, headers, chunks=[body]).status == 429  # the rate is one a minute


def _session_cookie(user, tenant_slug: str) -> str:
    session = SessionStore()
    session["_auth_user_id"] = str(user.pk)
    session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
    session["_auth_user_hash"] = user.get_session_auth_hash()
    session[SESSION_TENANT_KEY] = tenant_slug
    session.save()
    return f"sessionid={session.session_key}"


def test_the_dashboard_upload_follows_the_signed_in_persons_tenant(tenant_a, adapter_a):
    tenant_a.tenant.max_upload_bytes = 500_000
    tenant_a.tenant.save()
    path = "/adapters/support-bot/register/"
    developer = {"cookie": _session_cookie(tenant_a.users["developer"], tenant_a.tenant.slug)}
    answer = call("POST", path, developer | {"content-type": "multipart/form-data; boundary=x"}, size=1_000_000)
    assert (answer.status, answer.chunks_read) == (413, 0)
    viewer = {"cookie": _session_cookie(tenant_a.users["viewer"], tenant_a.tenant.slug)}
    assert call("POST", path, viewer, size=1000).status == 403


def test_an_upload_within_the_limits_reaches_the_view(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    _, token = tenant_a.key("pipeline")
    files = [SimpleUploadedFile(p.name, p.read_bytes()) for p in sorted(good_adapter_dir.iterdir())]
    body = encode_multipart(BOUNDARY, {"files": files})
    headers = {"authorization": f"Bearer {token}", "content-type": MULTIPART_CONTENT}
    answer = call("POST", UPLOAD, headers, chunks=[body[i : i + CHUNK] for i in range(0, len(body), CHUNK)])
    assert answer.status == 201, answer.body
    assert AdapterRevision.objects.get().size_bytes == sum(p.stat().st_size for p in good_adapter_dir.iterdir())


# ---------------------------------------------------------------- multipart files: how many, and how they are held


def _multipart(count: int) -> bytes:
    return encode_multipart(BOUNDARY, {"files": [SimpleUploadedFile(f"f{i}.txt", b"data") for i in range(count)]})


def test_ordinary_forms_take_a_handful_of_files(client, settings):
    settings.MINT_FORM_MAX_FILES = 100
    response = client.generic("POST", "/login/", _multipart(101), content_type=MULTIPART_CONTENT)
    assert response.status_code == 400


def test_the_upload_route_takes_more_files_than_ordinary_forms(tenant_a, adapter_a, artifact_root, settings):
    settings.MINT_FORM_MAX_FILES = 100
    # Names and a config that pass registration's check (adapters/artifacts/precheck.py); validation refuses later.
    files = [SimpleUploadedFile(f"shard-{i}.safetensors", b"x") for i in range(150)]
    files.append(SimpleUploadedFile("adapter_config.json", json.dumps(lora_config()).encode()))
    response = tenant_a.client_as("key:pipeline").post(UPLOAD, {"files": files}, format="multipart")
    assert response.status_code == 201, response.content


def test_the_upload_route_refuses_more_than_its_own_file_limit(tenant_a, adapter_a, artifact_root, settings):
    settings.MINT_UPLOAD_MAX_FILES = 120
    files = [SimpleUploadedFile(f"shard-{i}.txt", b"x") for i in range(121)]
    response = tenant_a.client_as("key:pipeline").post(UPLOAD, {"files": files}, format="multipart")
    assert response.status_code == 400
    assert error_of(response)["code"] == "too_many_files"
    assert not list(artifact_root.rglob("*.txt"))


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_parsed_upload_files_hold_no_descriptor_open_and_vanish_when_closed(rf, settings):
    settings.MINT_FORM_MAX_FILES = 1000
    body = encode_multipart(BOUNDARY, {"files": [SimpleUploadedFile(f"f{i}", b"y" * 5000) for i in range(600)]})
    request = rf.generic("POST", "/", body, content_type=MULTIPART_CONTENT)
    before = _open_descriptors()
    meta = request.META | {"CONTENT_LENGTH": str(len(body))}
    _, parsed = MultiPartParser(meta, request, request.upload_handlers).parse()
    files = parsed.getlist("files")
    assert len(files) == 600
    assert _open_descriptors() - before < 10  # Django's temporary-file handler would hold 600
    paths = [f.temporary_file_path() for f in files]
    assert files[0].read() == b"y" * 5000
    for uploaded in files:
        uploaded.close()
    assert not any(os.path.exists(p) for p in paths)
