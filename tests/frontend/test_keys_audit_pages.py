"""The API keys page (owners) and the audit log page: behaviour beyond permissions."""

from __future__ import annotations

import pytest

from adapters.models import Adapter
from tenants.access import Actor
from tenants.auth import authenticate_token
from tenants.models import ApiKey
from tenants.services import audit_record
from tests.frontend.conftest import page_client

pytestmark = pytest.mark.django_db


def test_owner_creates_a_key_and_sees_its_token_once(tenant_a):
    client = page_client(tenant_a.users["owner"])
    response = client.post("/keys/", {"name": "trainer", "scopes": ["pipeline", "deploy"]}, follow=True)
    content = response.content.decode()
    key = ApiKey.objects.get(tenant=tenant_a.tenant, name="trainer")
    token = content.split("data-token", 1)[0].rsplit('value="', 1)[1].split('"', 1)[0]
    assert token.startswith(f"mint_{key.prefix}_")
    assert authenticate_token(token).id == key.id
    assert 'data-copy="#new-token"' in content
    assert response["Cache-Control"] == "no-store"
    again = client.get("/keys/").content.decode()
    assert token not in again and "trainer" in again
    assert key.scopes == ["deploy", "pipeline"] and key.created_by == tenant_a.users["owner"]


def test_a_key_is_made_with_its_adapters_and_token_limits(tenant_a, dense_base):
    for name in ("support-bot", "triage"):
        Adapter.objects.create(tenant=tenant_a.tenant, name=name, base_model=dense_base)
    client = page_client(tenant_a.users["owner"])
    form = {
        "name": "bot-only",
        "scopes": ["inference"],
        "adapters": "support-bot, triage",
        "max_tokens_per_minute": "2000",
        "monthly_token_budget": "500000",
    }
    response = client.post("/keys/", form, follow=True)

    key = ApiKey.objects.get(tenant=tenant_a.tenant, name="bot-only")
    assert (key.adapters, key.max_tokens_per_minute, key.monthly_token_budget) == (
        ["support-bot", "triage"],
        2000,
        500000,
    )
    assert "adapters: support-bot, triage" in response.content.decode()


def test_an_allow_list_naming_no_adapter_of_the_tenant_is_refused(tenant_a, tenant_b, adapter_a, adapter_b):
    client = page_client(tenant_a.users["owner"])
    form = {"name": "typo", "scopes": ["inference"], "adapters": f"support-bot, suport-bot, {adapter_b.name}"}
    response = client.post("/keys/", form, follow=True)
    shown = response.content.decode()
    assert f"no adapter named suport-bot, {adapter_b.name} in acme." in shown  # another tenant's is none of A's
    assert not ApiKey.objects.filter(tenant=tenant_a.tenant, name="typo").exists()


def test_a_bad_key_limit_is_named_and_nothing_is_made(tenant_a):
    client = page_client(tenant_a.users["owner"])
    response = client.post(
        "/keys/",
        {"name": "x", "scopes": ["inference"], "adapters": "Not A Name", "max_tokens_per_minute": "0"},
        follow=True,
    )

    assert "Ensure this value is greater than or equal to 1." in response.content.decode()
    assert not ApiKey.objects.filter(tenant=tenant_a.tenant, name="x").exists()
    again = client.post("/keys/", {"name": "x", "scopes": ["inference"], "adapters": "Not A Name"}, follow=True)
    assert "not adapter names" in again.content.decode()  # the service's refusal, next to the form
    assert not ApiKey.objects.filter(tenant=tenant_a.tenant, name="x").exists()


def test_invalid_key_form_shows_errors(tenant_a):
    response = page_client(tenant_a.users["owner"]).post("/keys/", {"name": ""}, follow=True)
    assert response.redirect_chain == [("/keys/#result-create-key", 302)]  # post/redirect/get, errors too
    assert "This field is required." in response.content.decode()
    assert not ApiKey.objects.filter(tenant=tenant_a.tenant).exists()


def test_owner_revokes_a_key(tenant_a):
    key, _token = tenant_a.key("inference")
    client = page_client(tenant_a.users["owner"])
    assert f"/keys/{key.prefix}/revoke/" in client.get("/keys/").content.decode()
    response = client.post(f"/keys/{key.prefix}/revoke/", follow=True)
    assert "revoked" in response.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert tenant_a.tenant.audit_events.filter(action="api_key.revoke", target=f"api_key:{key.prefix}").exists()


def test_audit_log_filters_and_pages(tenant_a, tenant_b):
    for n in range(60):
        audit_record(
            tenant=tenant_a.tenant,
            actor=Actor(user=tenant_a.users["developer"]),
            action="revision.register",
            target=f"revision:bot@r{n}",
        )
    audit_record(
        tenant=tenant_a.tenant, actor=Actor(user=tenant_a.users["owner"]), action="api_key.create", target="api_key:abc"
    )
    audit_record(
        tenant=tenant_b.tenant,
        actor=Actor(user=tenant_b.users["owner"]),
        action="api_key.create",
        target="api_key:globex",
    )
    client = page_client(tenant_a.users["viewer"])
    first = client.get("/audit/").content.decode()
    assert "61 events" in first and "Page 1 of 2" in first and "api_key:abc" in first
    assert "revision:bot@r59" in first and "revision:bot@r0<" not in first
    second = client.get("/audit/?page=2").content.decode()
    assert "revision:bot@r0<" in second
    filtered = client.get("/audit/?action=api_key.create").content.decode()
    assert "1 event" in filtered and "api_key:abc" in filtered and "revision:bot" not in filtered
    assert "globex" not in filtered
    by_target = client.get("/audit/?target=bot@r5").content.decode()
    assert "revision:bot@r5<" in by_target and "revision:bot@r6<" not in by_target
    by_actor = client.get("/audit/?actor=acme-owner").content.decode()
    assert "api_key:abc" in by_actor and "revision:bot" not in by_actor
    paged = client.get("/audit/?action=revision.register&page=1").content.decode()
    assert "action=revision.register&amp;page=2" in paged
