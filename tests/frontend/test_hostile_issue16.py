"""Hostile review of issue 16's dashboard additions: audit date range, per-alias controls, revision pages."""

from __future__ import annotations

import pytest

from serving.models import Alias

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("query", ["until=9999-12-31", "since=2026-01-01&until=9999-12-31"])
@pytest.mark.parametrize("path", ["/audit/", "/audit/export.csv"])
def test_the_last_representable_day_is_no_server_error(catalog_a, as_role, path, query):
    response = as_role("viewer").get(f"{path}?{query}")
    if path.endswith(".csv"):
        assert response.status_code == 200
        b"".join(response.streaming_content)
    else:
        assert response.status_code == 200


@pytest.mark.parametrize("alias", ["Prod", "a b", "x@r1", "a:b", "ünï", "-x", "a/b"])
def test_the_dashboard_refuses_alias_names_the_api_refuses(catalog_a, as_role, alias):
    client = as_role("owner")
    response = client.post(
        "/adapters/support-bot/activate/", {"revision": 2, "alias": alias}, HTTP_X_REQUESTED_WITH="fetch"
    )
    assert response.status_code == 400, response.content
    assert not Alias.objects.filter(adapter=catalog_a.adapter, name=alias).exists()
    for action in ("rollback", "cancel"):
        response = client.post(f"/adapters/support-bot/{action}/", {"alias": alias}, HTTP_X_REQUESTED_WITH="fetch")
        assert response.status_code == 400, (action, response.content)


@pytest.mark.parametrize("number", ["99999999999", "99999999999999999999"])
def test_a_huge_revision_number_is_not_found(catalog_a, as_role, number):
    client = as_role("owner")
    assert client.get(f"/adapters/support-bot/revisions/{number}/").status_code == 404
    response = client.post(f"/adapters/support-bot/revisions/{number}/retry/", HTTP_X_REQUESTED_WITH="fetch")
    assert response.status_code == 404
    response = client.post("/adapters/support-bot/activate/", {"revision": number}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.status_code in (400, 404)


def test_the_csv_export_streams_under_asgi_rather_than_being_built_whole(catalog_a, tenant_a, recwarn):
    """Served by ASGI (as MinT is), a synchronous iterator is first read whole into a list (Django warns):
    up to AUDIT_EXPORT_MAX_ROWS rows in memory per request. The export must stream as it says."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def export() -> bytes:
        client = AsyncClient()
        await client.aforce_login(tenant_a.users["viewer"])
        response = await client.get("/audit/export.csv")
        assert response.status_code == 200
        return b"".join([part async for part in response])  # as ASGIHandler.send_response reads it

    from tenants.models import AuditEvent

    AuditEvent.objects.bulk_create(
        AuditEvent(tenant=tenant_a.tenant, actor="bulk", action="test.row", target=f"t{i}") for i in range(1203)
    )
    body = async_to_sync(export)()
    assert body.startswith(b"at_utc,actor,action,target,before,after")
    assert body.count(b",test.row,") == 1203
    assert body.count(b"\n") == AuditEvent.objects.filter(tenant=tenant_a.tenant).count() + 1
    assert not [w for w in recwarn if "consume synchronous iterators" in str(w.message)]


def test_failed_sign_ins_by_strangers_store_no_session_rows(db):
    """A refused sign-in must not write a session row: with AXES counting per username and address, a stranger
    varying the username could otherwise fill the session table (kept two weeks) without bound."""
    from django.contrib.sessions.models import Session
    from django.test import Client

    for i in range(5):
        response = Client().post("/login/", {"username": f"nobody-{i}", "password": "wrong"})
        assert response.status_code == 302
    assert Session.objects.count() == 0


def test_a_refused_sign_in_still_says_so_and_keeps_the_username(db):
    from django.test import Client

    client = Client()
    response = client.post("/login/", {"username": "someone", "password": "wrong"}, follow=True)
    page = response.content.decode()
    assert 'id="login-error"' in page and 'value="someone"' in page
    again = client.get("/login/").content.decode()
    assert 'id="login-error"' not in again  # said once
