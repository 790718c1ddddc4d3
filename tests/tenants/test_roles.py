"""Each role and key scope can do exactly what DESIGN.md §3/§6 says on the endpoints that exist."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ALL_SCOPES

pytestmark = pytest.mark.django_db

ROLES = ["owner", "approver", "developer", "viewer"]
KEYS = ["key:pipeline", "key:deploy", "key:inference", f"key:{ALL_SCOPES}"]

# (method, path) → the principals that get through; everybody else is refused with 403.
ALLOWED = {
    ("GET", "/api/v1/"): {
        "owner",
        "approver",
        "developer",
        "viewer",
        "key:pipeline",
        "key:deploy",
        f"key:{ALL_SCOPES}",
    },
    ("GET", "/api/v1/audit/"): {
        "owner",
        "approver",
        "developer",
        "viewer",
        "key:pipeline",
        "key:deploy",
        f"key:{ALL_SCOPES}",
    },
    ("GET", "/api/v1/keys/"): {"owner"},
    ("POST", "/api/v1/keys/"): {"owner"},
    ("DELETE", "/api/v1/keys/{prefix}/"): {"owner"},
}
SUCCESS = {"GET": 200, "POST": 201, "DELETE": 204}


@pytest.mark.parametrize("principal", ROLES + KEYS)
@pytest.mark.parametrize(("method", "path"), list(ALLOWED))
def test_role_and_scope_matrix(tenant_a, principal, method, path):
    victim, _ = tenant_a.key("inference")
    url = path.format(prefix=victim.prefix)
    client = tenant_a.client_as(principal)
    body = {"name": "new", "scopes": ["inference"]} if method == "POST" else None
    response = client.generic(
        method, url, data=None if body is None else json.dumps(body), content_type="application/json"
    )
    if principal in ALLOWED[(method, path)]:
        assert response.status_code == SUCCESS[method], response.content
    else:
        assert response.status_code == 403, response.content
        assert response.json()["error"]["code"] in {"forbidden", "insufficient_scope"}


def test_outsider_signed_in_is_refused(tenant_a):
    response = tenant_a.client_as("outsider").get("/api/v1/")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "no_tenant"


def test_anonymous_is_asked_to_authenticate(client, db):
    response = client.get("/api/v1/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


def test_member_of_two_tenants_names_one(tenant_a, tenant_b):
    from tenants.models import Membership, Role

    person = tenant_a.users["viewer"]
    Membership.objects.create(user=person, tenant=tenant_b.tenant, role=Role.OWNER)
    client = tenant_a.client_as("viewer")

    ambiguous = client.get("/api/v1/")
    assert ambiguous.status_code == 400
    assert "X-Mint-Tenant" in ambiguous.json()["error"]["message"]

    as_viewer = client.get("/api/v1/", HTTP_X_MINT_TENANT="acme").json()
    as_owner = client.get("/api/v1/", HTTP_X_MINT_TENANT="globex").json()
    assert (as_viewer["tenant"], as_viewer["role"]) == ("acme", "viewer")
    assert (as_owner["tenant"], as_owner["role"]) == ("globex", "owner")
    # The viewer role in acme does not borrow the owner role from globex.
    assert client.get("/api/v1/keys/", HTTP_X_MINT_TENANT="acme").status_code == 403
    assert client.get("/api/v1/keys/", HTTP_X_MINT_TENANT="globex").status_code == 200


def test_naming_a_tenant_you_do_not_belong_to_is_a_404(tenant_a, tenant_b):
    client = tenant_a.client_as("owner")
    for slug in ("globex", "no-such-tenant"):
        response = client.get("/api/v1/", HTTP_X_MINT_TENANT=slug)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "tenant_not_found"
