"""Tenants are walled off: every tenant route, enumerated from the URL configuration, hides tenant B from A.

New routes are covered automatically. A route with a URL parameter this test does not
know how to fill with one of tenant B's objects fails the test, so whoever adds the
route also adds the way to reach tenant B's object here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, BaseModel, EvaluationSuite, UploadSession
from serving.models import UsagePeriod, UsageRecord
from tenants.api_base import TenantApi
from tenants.models import ApiKey, Invitation, Membership, Tenant
from tests.conftest import ALL_SCOPES, TenantWorld
from webhooks.models import WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db


def b_revision(b: TenantWorld) -> AdapterRevision:
    """Tenant B's adapter `globex-only-bot` with a revision r1 (made once)."""
    base, _ = BaseModel.objects.get_or_create(
        name="cross-tenant-base", defaults={"architecture": "dense", "config": {}, "max_lora_rank": 16}
    )
    adapter, _ = Adapter.objects.get_or_create(tenant=b.tenant, name="globex-only-bot", base_model=base)
    revision, _ = AdapterRevision.objects.get_or_create(
        adapter=adapter, number=1, defaults={"state": "approved", "source_uri": "x"}
    )
    return revision


def b_usage(b: TenantWorld, revision: AdapterRevision, *, key: ApiKey) -> None:
    """Tenant B's metered use of its revision with its key, a minute ago (what `GET /api/v1/usage/` reads)."""
    UsageRecord.objects.create(
        period=UsagePeriod.MINUTE,
        start=timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=1),
        tenant=b.tenant,
        key_id=key.id,
        adapter_id=revision.adapter_id,
        adapter_name=revision.adapter.name,
        revision=revision.number,
        node="globex-node",
        status=200,
        requests=1,
    )


def b_suite(b: TenantWorld) -> EvaluationSuite:
    """Tenant B's evaluation suite v1 on `globex-only-bot` (made once)."""
    suite, _ = EvaluationSuite.objects.get_or_create(
        adapter=b_revision(b).adapter, version=1, defaults={"cases": [], "case_count": 0}
    )
    return suite


def b_webhook(b: TenantWorld) -> WebhookEndpoint:
    """Tenant B's webhook endpoint (made once)."""
    endpoint, _ = WebhookEndpoint.objects.get_or_create(
        tenant=b.tenant, url="https://globex.example/hook", defaults={"secret": "whsec_globex"}
    )
    return endpoint


def b_delivery(b: TenantWorld) -> WebhookDelivery:
    """A delivery to tenant B's webhook endpoint (made once)."""
    endpoint = b_webhook(b)
    delivery = WebhookDelivery.objects.filter(endpoint=endpoint).first()
    return delivery or WebhookDelivery.objects.create(endpoint=endpoint, event="ping", payload={}, state="delivered")


def b_upload(b: TenantWorld) -> UploadSession:
    """Tenant B's open resumable-upload session on `globex-only-bot` (made once)."""
    adapter = b_revision(b).adapter
    return UploadSession.objects.filter(adapter=adapter).first() or UploadSession.objects.create(
        tenant=b.tenant,
        adapter=adapter,
        size=10,
        sha256="0" * 64,
        filename="adapter.tar",
        part_size=8 * 1024 * 1024,
        expires_at=timezone.now() + timedelta(days=1),
    )


def b_run(b: TenantWorld) -> str:
    """Tenant B's training run `globex-run`, of its revision r1 (adapters/runs.py)."""
    AdapterRevision.objects.filter(id=b_revision(b).id).update(run="globex-run", training_step=1)
    return "globex-run"


def b_invitation(b: TenantWorld) -> Invitation:
    """A pending invitation into tenant B (made once)."""
    invitation, _ = Invitation.objects.get_or_create(
        tenant=b.tenant,
        email="new@globex.example",
        defaults={"role": "approver", "nonce": "globex", "expires_at": timezone.now() + timedelta(days=1)},
    )
    return invitation


# How to name one of tenant B's objects for each URL parameter.
B_OBJECT: dict[str, Callable[[TenantWorld], str]] = {
    "username": lambda b: b.users["approver"].get_username(),
    "invitation_id": lambda b: str(b_invitation(b).id),
    "prefix": lambda b: b.key("pipeline")[0].prefix,
    "name": lambda b: b_revision(b).adapter.name,
    "number": lambda b: str(b_revision(b).number),
    "version": lambda b: str(b_suite(b).version),
    "webhook_id": lambda b: str(b_webhook(b).id),
    "delivery_id": lambda b: str(b_delivery(b).id),
    "upload_id": lambda b: str(b_upload(b).id),
    "run": lambda b: b_run(b),
}

PARAM = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<name>[^>]+)>")


def tenant_routes() -> list[tuple[str, type[TenantApi]]]:
    found = []

    def walk(patterns, prefix: str) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + str(entry.pattern))
            elif isinstance(entry, URLPattern):
                view = getattr(entry.callback, "view_class", None)
                if view is not None and issubclass(view, TenantApi):
                    found.append(("/" + prefix + str(entry.pattern), view))

    walk(get_resolver().url_patterns, "")
    return found


def handled_methods(view: type[TenantApi]) -> list[str]:
    return [m.upper() for m in view.http_method_names if m not in ("options", "head") and hasattr(view, m)]


def test_routes_are_found():
    routes = dict(tenant_routes())
    assert "/api/v1/keys/<str:prefix>/" in routes
    assert "/api/v1/audit/" in routes
    assert "/api/v1/usage/" in routes
    assert "/api/v1/adapters/<str:name>/revisions/<int:number>/approve/" in routes


@pytest.mark.parametrize("principal", ["owner", f"key:{ALL_SCOPES}"])
def test_object_routes_answer_404_for_another_tenants_objects(tenant_a, tenant_b, principal):
    # Two requests per route and method, far past a plan's burst: the throttle (tests/tenants/test_throttles.py)
    # would answer 429 before the object is looked up, which is not what this test is about.
    Tenant.objects.filter(id=tenant_a.tenant.id).update(
        api_read_rpm=100_000, api_write_rpm=100_000, api_tenant_write_rpm=100_000
    )
    client = tenant_a.client_as(principal)
    checked = 0
    for route, view in tenant_routes():
        params = [m.group("name") for m in PARAM.finditer(route)]
        if not params:
            continue
        missing = [p for p in params if p not in B_OBJECT]
        assert not missing, f"{route}: add a tenant-B object for {missing} to B_OBJECT"
        url = PARAM.sub(lambda m: B_OBJECT[m.group("name")](tenant_b), route)
        missing_url = PARAM.sub(lambda m: "9999" if m.group("converter") == "int" else "no-such-object", route)
        for method in handled_methods(view):
            response = client.generic(method, url, data="{}", content_type="application/json")
            missing = client.generic(method, missing_url, data="{}", content_type="application/json")
            where = f"{method} {url} as {principal}"
            # Another tenant's object looks exactly like a missing one …
            assert (response.status_code, response.json()) == (missing.status_code, missing.json()), where
            # … which is a 404, unless the caller may not use this route at all (then 403 for any object).
            if response.status_code == 403:
                assert principal.startswith("key:"), where
                assert response.json()["error"]["code"] == "insufficient_scope", where
            else:
                assert response.status_code == 404, f"{where}: {response.status_code}"
                assert response.json()["error"]["code"] == "not_found"
            checked += 1
    assert checked > 0


def test_list_routes_never_show_another_tenants_data(tenant_a, tenant_b):
    b_key, _ = tenant_b.key("pipeline")
    revision = b_revision(tenant_b)
    b_usage(tenant_b, revision, key=b_key)
    b_delivery(tenant_b)
    client = tenant_a.client_as("owner")
    secrets_of_b = {b_key.prefix, "globex"}
    for route, view in tenant_routes():
        if PARAM.search(route) or not hasattr(view, "get"):
            continue
        response = client.get(route)
        assert response.status_code == 200, route
        text = json.dumps(response.json())
        leaked = [s for s in secrets_of_b if s in text]
        assert not leaked, f"{route} shows tenant B's {leaked}"


# ---------------------------------------------------------------------------------------------
# People: an owner of tenant A manages A's people only, whatever tenant the request names.


def test_an_owner_of_a_cannot_invite_into_list_or_change_b(tenant_a, tenant_b):
    from django.core import mail

    b_invitation(tenant_b)
    client = tenant_a.client_as("owner")
    named_b = {"HTTP_X_MINT_TENANT": "globex"}
    for method, path, body in (
        ("get", "/api/v1/members/", None),
        ("get", "/api/v1/invitations/", None),
        ("post", "/api/v1/invitations/", {"email": "spy@acme.example", "role": "owner"}),
        ("patch", "/api/v1/members/globex-owner/", {"role": "viewer"}),
        ("delete", "/api/v1/members/globex-approver/", None),
        ("post", "/api/v1/members/globex-approver/transfer-ownership/", {}),
        ("get", "/api/v1/tenant/", None),
    ):
        answer = getattr(client, method)(path, body, format="json", **named_b)
        assert answer.status_code == 404, (method, path, answer.status_code)
        assert answer.json()["error"]["code"] == "tenant_not_found", (method, path)
        assert "globex-" not in answer.content.decode()
    # Without naming B, the same requests act on A: B's people are not A's.
    assert client.patch("/api/v1/members/globex-owner/", {"role": "viewer"}, format="json").status_code == 404
    assert client.delete("/api/v1/members/globex-approver/").status_code == 404
    b_pending = b_invitation(tenant_b)
    assert client.delete(f"/api/v1/invitations/{b_pending.id}/").status_code == 404
    listed = client.get("/api/v1/members/").json()
    assert {m["username"] for m in listed} == {f"acme-{role}" for role in ("owner", "approver", "developer", "viewer")}
    # An invitation made in A never makes anyone a member of B.
    assert (
        client.post("/api/v1/invitations/", {"email": "new@globex.example", "role": "owner"}, format="json").status_code
        == 201
    )
    assert mail.outbox[0].to == ["new@globex.example"]
    roles_b = dict(Membership.objects.filter(tenant=tenant_b.tenant).values_list("user__username", "role"))
    assert roles_b == {f"globex-{role}": role for role in ("owner", "approver", "developer", "viewer")}
    b_pending.refresh_from_db()
    assert b_pending.state == "pending" and Invitation.objects.filter(tenant=tenant_b.tenant).count() == 1


# ---------------------------------------------------------------------------------------------
# Download links (adapters/downloads.py): a link is the capability for one file of one revision. Tenant A never
# gets one for B's revision (the route answers 404, above), and no edit of A's link reaches B's files.


def test_a_download_link_of_a_cannot_be_bent_to_bs_revision(tenant_a, tenant_b, client):
    from django.core import signing

    b_rev = b_revision(tenant_b)
    AdapterRevision.objects.filter(id=b_rev.id).update(
        export_uri="t/b/export", policy_record={"files": [{"name": "adapter_model.safetensors"}]}
    )
    base = BaseModel.objects.get(name="cross-tenant-base")
    a_adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="acme-bot", base_model=base)
    a_rev = AdapterRevision.objects.create(
        adapter=a_adapter,
        number=1,
        state="approved",
        source_uri="x",
        export_uri="t/a/export",
        policy_record={"files": [{"name": "adapter_model.safetensors"}]},
    )
    link = tenant_a.client_as("owner").get("/api/v1/adapters/acme-bot/revisions/1/download/").json()["files"][0]
    token = link["url"].rstrip("/").rsplit("/", 1)[-1]
    payload = signing.loads(token, salt="mint.adapters.download")
    assert payload == {"r": a_rev.id, "f": "adapter_model.safetensors"}
    # The payload is signed: naming B's revision in it breaks the signature, whatever else stays the same.
    _, _, signature = token.rpartition(":")
    forged = signing.dumps({"r": b_rev.id, "f": "adapter_model.safetensors"}, salt="mint.adapters.download")
    bent = forged.rpartition(":")[0] + ":" + signature
    for attempt in (bent, forged.replace(forged[:4], token[:4], 1)):
        response = client.get(f"/api/v1/downloads/{attempt}/")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    denied = tenant_a.client_as("owner").get(f"/api/v1/adapters/{b_rev.adapter.name}/revisions/1/download/")
    assert denied.status_code == 404
