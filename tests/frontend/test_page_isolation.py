"""Tenants are walled off in the dashboard too: every dashboard route, enumerated from the URL configuration.

A GET of any page (and any live fragment) as any member of tenant A never shows tenant B's
names; a GET or POST naming one of B's objects is "not found" and changes nothing. A new
route with a parameter this test cannot fill fails it, so whoever adds one extends it.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from adapters.models import AdapterRevision
from frontend import urls as frontend_urls
from serving.models import Alias
from tenants.models import ApiKey, Invitation
from tests.frontend.conftest import page_client
from webhooks.models import WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db

PARAM = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<name>[^>]+)>")
B_NAMES = ["globex", "globex-secret-bot", "b-secret-key"]
FRAGMENTS = {
    "/": ["adapters", "nodes"],
    "/adapters/<str:name>/": ["alias", "revisions", "retention"],
    "/adapters/<str:name>/revisions/<int:number>/": ["alias", "revisions", "room", "lineage"],
    "/nodes/": ["nodes"],
    "/keys/": ["keys"],
}


def dashboard_routes() -> list[str]:
    found = []

    def walk(patterns, prefix: str) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + str(entry.pattern))
            elif isinstance(entry, URLPattern) and entry.callback.__module__.startswith("frontend."):
                found.append("/" + prefix + str(entry.pattern))

    walk(get_resolver().url_patterns, "")
    return found


def fill_route(route: str, values: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        name = match.group("name")
        if name not in values:
            raise AssertionError(f"{route}: teach this test how to name tenant B's {name!r}")
        return values[name]

    return PARAM.sub(one, route)


@pytest.fixture
def both(catalog_a, catalog_b, tenant_a, tenant_b):
    tenant_b.tenant.name = "Globex Corporation"
    tenant_b.tenant.save(update_fields=["name"])
    b_key, _ = tenant_b.key("pipeline")
    ApiKey.objects.filter(id=b_key.id).update(name="b-secret-key")
    b_hook = WebhookEndpoint.objects.create(tenant=tenant_b.tenant, url="https://globex.example/hook", secret="s")
    b_delivery = WebhookDelivery.objects.create(
        endpoint=b_hook, event="revision.approved", subject="adapter:globex-secret-bot:r1", payload={}
    )
    b_invitation = Invitation.objects.create(
        tenant=tenant_b.tenant,
        email="someone@globex.example",
        role="viewer",
        nonce="b",
        expires_at=timezone.now() + timedelta(days=1),
    )
    return {
        "name": catalog_b.adapter.name,
        "number": "1",
        "prefix": b_key.prefix,
        "webhook_id": str(b_hook.id),
        "delivery_id": str(b_delivery.id),
        "username": tenant_b.users["approver"].get_username(),
        "invitation_id": str(b_invitation.id),
        **PUBLIC,
        **FILE,
    }


# Pages of links mailed to people (an invitation, a password reset) and single sign-on's start: no tenant's
# objects but what the link's own signed token names (whoever holds the link may read it: it is mailed to
# the person it is for). A made-up token is not found.
PUBLIC = {"token": "no-such-token", "uidb64": "MQ", "slug": "acme"}
# A revision's exported file, by name (the same name in every revision of every tenant).
FILE = {"filename": "adapter_model.safetensors"}


def test_every_dashboard_route_is_covered():
    routes = set(dashboard_routes())
    assert "/" in routes and "/adapters/<str:name>/revisions/<int:number>/approve/" in routes
    # Each route once: the top level's, less the one that includes the adapter's, and the adapter's.
    assert len(routes) == len(frontend_urls.urlpatterns) - 1 + len(frontend_urls.adapter_patterns)


@pytest.mark.parametrize("role", ["owner", "approver", "developer", "viewer"])
def test_pages_of_a_never_show_b(both, tenant_a, role):
    client = page_client(tenant_a.users[role])
    own = {
        "name": "support-bot",
        "number": "1",
        "prefix": tenant_a.key("inference")[0].prefix,
        "webhook_id": "1",
        "delivery_id": "1",
        "username": tenant_a.users["viewer"].get_username(),
        "invitation_id": "1",
        **PUBLIC,
        **FILE,
    }
    for route in dashboard_routes():
        url = fill_route(route, own)
        urls = [url] + [f"{url}?fragment={f}" for f in FRAGMENTS.get(route, [])]
        for u in urls:
            response = client.get(u)
            body = b"".join(response.streaming_content) if response.streaming else response.content
            content = body.decode()
            for name in B_NAMES:
                assert name not in content.lower(), f"{u} as {role} shows {name!r}"


@pytest.mark.parametrize("role", ["owner", "approver"])
def test_routes_naming_bs_objects_are_not_found_for_a(both, tenant_a, catalog_b, role):
    client = page_client(tenant_a.users[role])
    checked = 0
    for route in dashboard_routes():
        if not PARAM.search(route):
            continue
        url = fill_route(route, both)
        for method in ("get", "post"):
            response = getattr(client, method)(url, {"revision": "2", "comment": "x"})
            if response.status_code == 405:
                continue
            if route.startswith(("/invitations/<str", "/password-reset/<", "/sso/<")):
                # Public pages: a made-up link is not found (a reset link: "not valid any more"), and an SSO start
                # of a tenant without single sign-on too.
                assert response.status_code in (200, 404), f"{method.upper()} {url}: {response.status_code}"
                assert b"Invitation not found" in response.content or not route.startswith("/invitations/")
            elif role == "approver" and route.startswith(("/keys/", "/webhooks/<", "/members/<", "/invitations/<")):
                assert response.status_code == 403, url  # the role check comes first
            elif route.startswith("/nodes/"):
                assert response.status_code == 403, url  # nodes belong to no tenant: staff only
            else:
                assert response.status_code == 404, f"{method.upper()} {url}: {response.status_code}"
            for name in B_NAMES:
                assert name not in response.content.decode().lower()
            checked += 1
    assert checked >= 8
    assert AdapterRevision.objects.get(id=catalog_b.pending.id).state == "pending_approval"
    assert Alias.objects.get(adapter=catalog_b.adapter).desired_revision_id == catalog_b.approved.id
    assert ApiKey.objects.filter(tenant=catalog_b.adapter.tenant, revoked_at__isnull=False).count() == 0
    assert WebhookEndpoint.objects.filter(tenant=catalog_b.adapter.tenant).count() == 1
    assert WebhookDelivery.objects.count() == 1  # nothing redelivered or pinged


def test_nodes_page_counts_b_but_never_names_it(both, tenant_a):
    content = page_client(tenant_a.users["viewer"]).get("/nodes/").content.decode()
    assert "2 / 8" in content  # both tenants' ready placements fill the node
    assert "support-bot@r2" in content
    assert "globex" not in content.lower()
