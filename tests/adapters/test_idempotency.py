"""`Idempotency-Key` on the REST API's POSTs: the first answer again for a retry, and only for its own caller."""

from __future__ import annotations

import threading
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone

from adapters import services
from adapters.models import Adapter, AdapterRevision
from adapters.upload_gate import upload_allowance
from mint_site.limits import Refusal
from tenants import idempotency, tasks
from tenants.models import IdempotencyRecord
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

ADAPTERS = "/api/v1/adapters/"
UPLOAD = "/api/v1/adapters/support-bot/revisions/"
BODY = {"name": "support-bot", "base_model": "test-dense"}


def post(client, path, body, key, **kwargs):
    return client.post(path, body, format=kwargs.pop("format", "json"), HTTP_IDEMPOTENCY_KEY=key, **kwargs)


def test_a_retry_gets_the_first_answer_and_does_nothing_again(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    first = post(client, ADAPTERS, BODY, "create-support-bot")
    assert first.status_code == 201, first.content
    retry = post(client, ADAPTERS, BODY, "create-support-bot")
    assert (retry.status_code, retry.content) == (201, first.content)
    assert retry["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    assert Adapter.objects.count() == 1
    # Without the key, the same request runs (and meets the adapter the first one made).
    plain = client.post(ADAPTERS, BODY, format="json")
    assert plain.status_code == 409 and error_of(plain)["code"] == "adapter_exists"


def test_a_person_signed_in_gets_the_same(tenant_a, dense_base):
    client = tenant_a.client_as("developer")
    first = post(client, ADAPTERS, BODY, "k1")
    retry = post(client, ADAPTERS, BODY, "k1")
    assert (first.status_code, retry.status_code, retry.content) == (201, 201, first.content)
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().scope == f"user:{tenant_a.users['developer'].pk}@tenant:{tenant_a.tenant.id}"


def test_a_kept_error_is_replayed_too(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    bad = {"name": "Bad Name!", "base_model": "test-dense"}
    first = post(client, ADAPTERS, bad, "k-bad")
    retry = post(client, ADAPTERS, bad, "k-bad")
    assert (first.status_code, retry.status_code, retry.content) == (400, 400, first.content)
    assert retry["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize(
    ("second", "differs"),
    [
        ({"path": ADAPTERS, "body": {**BODY, "description": "other"}}, ["body"]),
        ({"path": UPLOAD, "body": {"source_uri": "t/1/incoming/x/"}}, ["path", "body"]),
    ],
)
def test_the_same_key_for_another_request_is_a_422_naming_what_differs(tenant_a, adapter_a, second, differs):
    client = tenant_a.client_as("key:pipeline")
    first = post(client, ADAPTERS, {**BODY, "name": "other-bot"}, "k1")
    assert first.status_code == 201
    refused = post(client, second["path"], second["body"], "k1")
    assert refused.status_code == 422
    error = error_of(refused)
    assert error["code"] == "idempotency_key_reused"
    assert error["detail"]["differs"] == differs
    assert error["detail"]["first_request"] == f"POST {ADAPTERS}"
    assert Adapter.objects.count() == 2  # adapter_a and other-bot; nothing from the refused request


def test_another_tenant_or_key_with_the_same_key_string_never_sees_the_first_answer(tenant_a, tenant_b, dense_base):
    first = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "shared-key")
    assert first.status_code == 201
    other_tenant = post(tenant_b.client_as("key:pipeline"), ADAPTERS, BODY, "shared-key")
    assert other_tenant.status_code == 201 and "Idempotent-Replayed" not in other_tenant
    assert Adapter.objects.filter(tenant=tenant_b.tenant, name="support-bot").exists()
    # Another key of the same tenant: its own claim, so the request runs (and finds the adapter made).
    other_key = post(tenant_a.client_as("key:deploy,pipeline"), ADAPTERS, BODY, "shared-key")
    assert other_key.status_code == 409 and "Idempotent-Replayed" not in other_key
    # A person of tenant A, and tenant B's person: their own claims too.
    person = post(tenant_a.client_as("developer"), ADAPTERS, BODY, "shared-key")
    assert person.status_code == 409 and "Idempotent-Replayed" not in person
    assert IdempotencyRecord.objects.filter(key="shared-key").count() == 4
    assert IdempotencyRecord.objects.filter(key="shared-key", tenant=tenant_b.tenant).count() == 1
    # Each caller's retry gets its own first answer back.
    again_b = post(tenant_b.client_as("key:pipeline"), ADAPTERS, BODY, "shared-key")
    assert (again_b.status_code, again_b.content) == (201, other_tenant.content)
    again_a = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "shared-key")
    assert (again_a.status_code, again_a.content) == (201, first.content)


def test_a_request_that_does_not_authenticate_claims_nothing(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    client.credentials(HTTP_AUTHORIZATION="Bearer mint_000000000000_wrong")
    refused = post(client, ADAPTERS, BODY, "k1")
    assert refused.status_code == 401
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("x" * 256, "idempotency_key_too_long"),
        ("has space", "invalid_idempotency_key"),
        ("é", "invalid_idempotency_key"),
    ],
)
def test_a_malformed_key_is_a_400(tenant_a, dense_base, key, code):
    refused = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, key)
    assert refused.status_code == 400 and error_of(refused)["code"] == code
    assert not Adapter.objects.exists()


def test_the_key_length_is_a_setting(tenant_a, dense_base, settings):
    settings.MINT_IDEMPOTENCY_KEY_MAX_LENGTH = 20
    refused = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "k" * 21)
    assert refused.status_code == 400 and "at most 20" in error_of(refused)["message"]
    assert post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "k" * 20).status_code == 201


def test_creating_an_api_key_refuses_the_header(tenant_a):
    refused = post(tenant_a.client_as("owner"), "/api/v1/keys/", {"name": "ci", "scopes": ["pipeline"]}, "k1")
    assert refused.status_code == 400 and error_of(refused)["code"] == "idempotency_not_supported"
    assert not IdempotencyRecord.objects.exists()


def test_a_claim_whose_request_died_is_taken_over_after_its_lease(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    with mock.patch.object(idempotency, "finish"):  # the process "dies" before keeping the answer
        assert post(client, ADAPTERS, {**BODY, "name": "a"}, "k1").status_code == 201
    record = IdempotencyRecord.objects.get()
    assert record.state == "in_progress"
    busy = post(client, ADAPTERS, {**BODY, "name": "a"}, "k1")
    assert busy.status_code == 409 and error_of(busy)["code"] == "idempotency_in_progress"
    IdempotencyRecord.objects.update(locked_until=timezone.now() - timedelta(seconds=1))
    taken = post(client, ADAPTERS, {**BODY, "name": "a"}, "k1")
    assert taken.status_code == 409 and error_of(taken)["code"] == "adapter_exists"  # it ran again
    assert IdempotencyRecord.objects.get().state == "completed"


def test_answers_that_say_try_again_are_not_kept(tenant_a, dense_base):
    tenant_a.tenant.max_adapters = 0
    tenant_a.tenant.save()
    client = tenant_a.client_as("key:pipeline")
    over = post(client, ADAPTERS, BODY, "k1")
    assert over.status_code == 429 and error_of(over)["code"] == "adapter_quota_exceeded"
    assert not IdempotencyRecord.objects.exists()
    tenant_a.tenant.max_adapters = 5
    tenant_a.tenant.save()
    assert post(client, ADAPTERS, BODY, "k1").status_code == 201  # the retry ran


def test_a_server_error_is_not_kept(tenant_a, dense_base):
    client = tenant_a.client_as("key:pipeline")
    client.raise_request_exception = False
    with mock.patch.object(services, "adapter_create", side_effect=RuntimeError("boom")):
        failed = post(client, ADAPTERS, BODY, "k1")
    assert failed.status_code == 500
    assert not IdempotencyRecord.objects.exists()
    assert post(client, ADAPTERS, BODY, "k1").status_code == 201


def test_an_answer_over_the_bound_is_not_kept(tenant_a, dense_base, settings):
    settings.MINT_IDEMPOTENCY_MAX_RESPONSE_BYTES = 10
    client = tenant_a.client_as("key:pipeline")
    assert post(client, ADAPTERS, BODY, "k1").status_code == 201
    assert IdempotencyRecord.objects.get().response_body is None
    retry = post(client, ADAPTERS, BODY, "k1")
    assert retry.status_code == 409
    assert error_of(retry)["code"] == "idempotency_response_not_kept" and error_of(retry)["detail"] == {"status": 201}
    assert Adapter.objects.count() == 1


def test_expired_keys_are_purged_and_may_be_used_again(tenant_a, dense_base, settings):
    client = tenant_a.client_as("key:pipeline")
    assert post(client, ADAPTERS, {**BODY, "name": "one"}, "k1").status_code == 201
    assert post(client, ADAPTERS, {**BODY, "name": "two"}, "k2").status_code == 201
    IdempotencyRecord.objects.filter(key="k1").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert idempotency.idempotency_purge() == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k2"]
    # An expired key (not yet purged) is a fresh key: the new request runs.
    IdempotencyRecord.objects.filter(key="k2").update(expires_at=timezone.now() - timedelta(seconds=1))
    again = post(client, ADAPTERS, {**BODY, "name": "three"}, "k2")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert settings.CELERY_BEAT_SCHEDULE["idempotency-purge"]["task"] == "tenants.tasks.idempotency_purge"
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    tasks.idempotency_purge.delay()  # what beat runs hourly
    assert not IdempotencyRecord.objects.exists()


def test_a_retried_upload_gets_its_revision_not_a_duplicate(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    client = tenant_a.client_as("key:pipeline")
    with django_capture_on_commit_callbacks(execute=True):
        first = post(client, UPLOAD, {"files": uploads_of(good_adapter_dir)}, "upload-1", format="multipart")
    assert first.status_code == 201, first.content
    # A retry frames the same files anew (another boundary): still the same request.
    retry = post(client, UPLOAD, {"files": uploads_of(good_adapter_dir)}, "upload-1", format="multipart")
    assert (retry.status_code, retry.content) == (201, first.content)
    assert AdapterRevision.objects.count() == 1
    # Other files under the same key: another request.
    other = uploads_of(good_adapter_dir)[:1]
    refused = post(client, UPLOAD, {"files": other}, "upload-1", format="multipart")
    assert refused.status_code == 422 and error_of(refused)["detail"]["differs"] == ["body"]


def test_the_upload_gate_answers_a_running_upload_before_its_body(tenant_a, adapter_a):
    key, token = tenant_a.key("pipeline")
    IdempotencyRecord.objects.create(
        scope=f"key:{key.id}",
        key="upload-1",
        tenant=tenant_a.tenant,
        api_key=key,
        method="POST",
        path=UPLOAD,
        fingerprint="0" * 64,
        locked_until=timezone.now() + timedelta(minutes=5),
        expires_at=timezone.now() + timedelta(days=1),
    )
    scope = {
        "type": "http",
        "method": "POST",
        "path": UPLOAD,
        "headers": [(b"authorization", f"Bearer {token}".encode()), (b"idempotency-key", b"upload-1")],
        "client": ("127.0.0.1", 1),
    }
    answer = upload_allowance(scope)
    assert isinstance(answer, Refusal) and (answer.status, answer.code) == (409, "idempotency_in_progress")
    scope["headers"][1] = (b"idempotency-key", b"x" * 300)
    answer = upload_allowance(scope)
    assert isinstance(answer, Refusal) and (answer.status, answer.code) == (400, "idempotency_key_too_long")
    scope["headers"][1] = (b"idempotency-key", b"upload-2")
    assert not isinstance(upload_allowance(scope), Refusal)


@pytest.mark.django_db(transaction=True)
def test_two_requests_with_one_key_at_once_run_once(tenant_a, dense_base):
    """Real PostgreSQL, two threads: the unique constraint lets one claim the key; the other hears 409."""
    entered, release = threading.Event(), threading.Event()
    real_create = services.adapter_create

    def slow_create(**kwargs):
        entered.set()
        assert release.wait(30)
        return real_create(**kwargs)

    answers = {}

    def send(name: str) -> None:
        try:
            answers[name] = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "same-key")
        finally:
            connection.close()

    tenant_a.key("pipeline")  # made before the threads, so both use one key
    with mock.patch.object(services, "adapter_create", side_effect=slow_create):
        first = threading.Thread(target=send, args=("first",))
        first.start()
        assert entered.wait(30)
        second = threading.Thread(target=send, args=("second",))
        second.start()
        second.join(30)
        release.set()
        first.join(30)
    assert answers["first"].status_code == 201, answers["first"].content
    assert answers["second"].status_code == 409
    assert error_of(answers["second"])["code"] == "idempotency_in_progress"
    assert Adapter.objects.count() == 1
    replay = post(tenant_a.client_as("key:pipeline"), ADAPTERS, BODY, "same-key")
    assert (replay.status_code, replay.content) == (201, answers["first"].content)


def _asgi_post(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
    """One POST through the real ASGI application (body limits, upload gate, async middleware chain)."""
    import asyncio

    from asgiref.sync import async_to_sync

    from mint_site.asgi import application

    async def run():
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"testserver"),
                (b"content-length", str(len(body)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in headers.items()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        pending = [body]
        sent: list[dict] = []

        async def receive():
            if not pending:
                await asyncio.sleep(3600)
            return {"type": "http.request", "body": pending.pop(), "more_body": False}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(application(scope, receive, send), timeout=60)
        start = next(m for m in sent if m["type"] == "http.response.start")
        out = {k.decode().lower(): v.decode() for k, v in start["headers"]}
        return start["status"], out, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    return async_to_sync(run)()


@pytest.mark.django_db(transaction=True)
def test_through_the_asgi_stack_an_upload_retry_is_replayed(tenant_a, adapter_a, good_adapter_dir, artifact_root):
    from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

    _, token = tenant_a.key("pipeline")
    body = encode_multipart(BOUNDARY, {"files": uploads_of(good_adapter_dir)})
    headers = {"authorization": f"Bearer {token}", "content-type": MULTIPART_CONTENT, "idempotency-key": "asgi-1"}
    with mock.patch("adapters.dispatch.dispatch_on_commit"):  # registration only: no validation here
        first = _asgi_post(UPLOAD, headers, body)
        assert first[0] == 201, first[2]
        again = _asgi_post(UPLOAD, headers, body)
    assert (again[0], again[2]) == (201, first[2])
    assert again[1]["idempotent-replayed"] == "true"
    revision = AdapterRevision.objects.get()
    assert revision.sha256  # digested while the body streamed in, through the middleware's parse
    json_headers = {"authorization": f"Bearer {token}", "content-type": "application/json", "idempotency-key": "asgi-2"}
    body = b'{"name": "asgi-bot", "base_model": "test-dense"}'
    created = _asgi_post(ADAPTERS, json_headers, body)
    replayed = _asgi_post(ADAPTERS, json_headers, body)
    assert (created[0], replayed[0], replayed[2]) == (201, 201, created[2])
    assert Adapter.objects.filter(name="asgi-bot").count() == 1


def test_a_tenant_keeps_a_bounded_number_of_keys(tenant_a, tenant_b, dense_base, settings):
    """The rows hold answers on the database every tenant shares: a tenant past its bound gets 429 for a new key,
    while its kept keys still replay and other tenants are untouched."""
    settings.MINT_IDEMPOTENCY_MAX_KEYS_PER_TENANT = 2
    client = tenant_a.client_as("key:pipeline")
    for i in range(2):
        assert post(client, ADAPTERS, BODY | {"name": f"bot-{i}"}, f"k-{i}").status_code == 201

    refused = post(client, ADAPTERS, BODY | {"name": "bot-2"}, "k-2")

    assert refused.status_code == 429 and error_of(refused)["code"] == "idempotency_keys_exhausted"
    assert not Adapter.objects.filter(name="bot-2").exists()
    assert post(client, ADAPTERS, BODY | {"name": "bot-0"}, "k-0")["Idempotent-Replayed"] == "true"
    other = post(tenant_b.client_as("key:pipeline"), ADAPTERS, BODY, "k-2")
    assert other.status_code == 201, other.content
