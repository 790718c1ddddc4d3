from __future__ import annotations

import hashlib
from datetime import timedelta
from io import StringIO
from unittest import mock

import pytest
from django.core.management import call_command
from django.utils import timezone

from tenants import services
from tenants.access import Actor
from tenants.models import ApiKey, AuditEvent
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def test_token_is_shown_once_and_only_its_hash_is_stored(tenant_a):
    owner = tenant_a.client_as("owner")
    created = owner.post("/api/v1/keys/", {"name": "trainer", "scopes": ["pipeline"]}, format="json")
    assert created.status_code == 201, created.content
    token = created.json()["token"]
    _, prefix, secret = token.split("_", 2)
    assert created.json()["prefix"] == prefix

    key = ApiKey.objects.get(prefix=prefix)
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    stored = " ".join(str(getattr(key, f.attname)) for f in ApiKey._meta.concrete_fields)
    assert secret not in stored

    listed = owner.get("/api/v1/keys/").json()["results"]
    assert [k["prefix"] for k in listed] == [prefix]
    assert "token" not in listed[0]
    assert secret not in owner.get("/api/v1/keys/").content.decode()


def test_new_key_authenticates_as_its_tenant(tenant_a):
    _, token = tenant_a.key("pipeline")
    response = tenant_a.client_as("owner").get("/api/v1/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200
    assert response.json()["tenant"] == "acme"
    assert response.json()["scopes"] == ["pipeline"]


def test_revoked_key_is_refused(tenant_a):
    key, _ = tenant_a.key("pipeline")
    assert tenant_a.client_as("owner").delete(f"/api/v1/keys/{key.prefix}/").status_code == 204
    response = tenant_a.client_as("key:pipeline").get("/api/v1/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "api_key_revoked"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_expired_key_is_refused(tenant_a):
    key, _ = tenant_a.key("pipeline")
    ApiKey.objects.filter(id=key.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = tenant_a.client_as("key:pipeline").get("/api/v1/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "api_key_expired"


def test_key_not_yet_expired_is_accepted(tenant_a):
    key, _ = tenant_a.key("pipeline")
    ApiKey.objects.filter(id=key.id).update(expires_at=timezone.now() + timedelta(hours=1))
    assert tenant_a.client_as("key:pipeline").get("/api/v1/").status_code == 200


@pytest.mark.parametrize(
    "token",
    ["mint_nope_secret", "not-a-mint-token", "mint__", "mint_abc"],
)
def test_unknown_or_malformed_key_is_refused(tenant_a, token):
    response = tenant_a.client_as("owner").get("/api/v1/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_right_prefix_with_wrong_secret_is_refused(tenant_a):
    key, _ = tenant_a.key("pipeline")
    response = tenant_a.client_as("owner").get("/api/v1/", HTTP_AUTHORIZATION=f"Bearer mint_{key.prefix}_guess")
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_wrong_scope_key_is_refused_with_403(tenant_a):
    response = tenant_a.client_as("key:inference").get("/api/v1/")
    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "insufficient_scope"
    assert "pipeline" in error["message"]


def test_keys_cannot_manage_keys_whatever_their_scopes(tenant_a):
    client = tenant_a.client_as("key:deploy,inference,pipeline")
    assert client.get("/api/v1/keys/").status_code == 403
    assert client.post("/api/v1/keys/", {"name": "x", "scopes": ["pipeline"]}, format="json").status_code == 403


def test_suspended_tenant_keys_are_refused(tenant_a):
    tenant_a.key("pipeline")
    tenant_a.tenant.is_active = False
    tenant_a.tenant.save()
    response = tenant_a.client_as("key:pipeline").get("/api/v1/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "tenant_inactive"


def test_last_used_at_is_written_at_most_once_a_minute(tenant_a):
    key, _ = tenant_a.key("pipeline")
    client = tenant_a.client_as("key:pipeline")
    client.get("/api/v1/")
    key.refresh_from_db()
    first = key.last_used_at
    assert first is not None

    client.get("/api/v1/")
    key.refresh_from_db()
    assert key.last_used_at == first

    later = first + timedelta(seconds=61)
    with mock.patch("tenants.services.timezone.now", return_value=later):
        client.get("/api/v1/")
    key.refresh_from_db()
    assert key.last_used_at == later


def test_create_key_rejects_unknown_scope_naming_the_field(tenant_a):
    response = tenant_a.client_as("owner").post("/api/v1/keys/", {"name": "x", "scopes": ["admin"]}, format="json")
    assert response.status_code == 400
    assert "scopes" in error_of(response)["message"]
    assert ApiKey.objects.count() == 0


def test_create_key_rejects_missing_name_naming_the_field(tenant_a):
    response = tenant_a.client_as("owner").post("/api/v1/keys/", {"scopes": ["pipeline"]}, format="json")
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("name:")


def test_create_key_rejects_expiry_in_the_past(tenant_a):
    past = (timezone.now() - timedelta(days=1)).isoformat()
    response = tenant_a.client_as("owner").post(
        "/api/v1/keys/", {"name": "x", "scopes": ["pipeline"], "expires_at": past}, format="json"
    )
    assert response.status_code == 400
    assert "expires_at" in error_of(response)["message"]
    assert ApiKey.objects.count() == 0


def test_malformed_json_is_a_400_not_a_crash(tenant_a):
    response = tenant_a.client_as("owner").post(
        "/api/v1/keys/", data='{"name": "x", "scopes": [', content_type="application/json"
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


def test_key_changes_are_audited_with_their_actor(tenant_a):
    owner = tenant_a.client_as("owner")
    prefix = owner.post("/api/v1/keys/", {"name": "ci", "scopes": ["deploy"]}, format="json").json()["prefix"]
    owner.delete(f"/api/v1/keys/{prefix}/")
    events = list(AuditEvent.objects.filter(target=f"api_key:{prefix}").order_by("id"))
    assert [e.action for e in events] == ["api_key.create", "api_key.revoke"]
    assert {e.actor for e in events} == {"acme-owner"}
    assert events[0].after["scopes"] == ["deploy"]
    assert events[1].before == {"state": "active"} and events[1].after == {"state": "revoked"}

    audit = owner.get("/api/v1/audit/?action=api_key.revoke").json()["results"]
    assert [e["target"] for e in audit] == [f"api_key:{prefix}"]


def test_revoking_twice_records_one_event(tenant_a):
    key, _ = tenant_a.key("pipeline")
    owner = tenant_a.client_as("owner")
    assert owner.delete(f"/api/v1/keys/{key.prefix}/").status_code == 204
    assert owner.delete(f"/api/v1/keys/{key.prefix}/").status_code == 204
    assert AuditEvent.objects.filter(action="api_key.revoke").count() == 1


def test_key_list_pins_its_query_count(tenant_a, django_assert_max_num_queries):
    for index in range(5):
        services.api_key_create(
            tenant=tenant_a.tenant,
            name=f"k{index}",
            scopes=["pipeline"],
            created_by=tenant_a.users["owner"],
            by=Actor.system(),
        )
    owner = tenant_a.client_as("owner")
    # session + user + memberships + the page of keys (with their creators joined)
    with django_assert_max_num_queries(4):
        response = owner.get("/api/v1/keys/")
    assert len(response.json()["results"]) == 5


def test_mint_key_command_prints_the_token_once(tenant_a):
    out, err = StringIO(), StringIO()
    call_command("mint_key", "create", "--tenant", "acme", "--scopes", "pipeline,deploy", stdout=out, stderr=err)
    token = out.getvalue().strip()
    assert token.startswith("mint_")
    prefix = token.split("_")[1]
    assert ApiKey.objects.get(prefix=prefix).scopes == ["deploy", "pipeline"]

    listing = StringIO()
    call_command("mint_key", "list", "--tenant", "acme", stdout=listing)
    assert prefix in listing.getvalue()
    assert token.split("_", 2)[2] not in listing.getvalue()

    call_command("mint_key", "revoke", prefix, stdout=StringIO())
    assert ApiKey.objects.get(prefix=prefix).state == "revoked"
