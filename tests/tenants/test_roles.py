"""Each role and key scope can do exactly what docs/tenants.md and docs/api.md say on the endpoints that exist."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from adapters.models import Adapter, AdapterRevision, BaseModel
from serving.models import Alias
from tenants import services
from tenants.access import Actor
from tenants.models import Scope
from tests.conftest import ALL_SCOPES

pytestmark = pytest.mark.django_db

ROLES = ["owner", "approver", "developer", "viewer"]
KEYS = ["key:pipeline", "key:deploy", "key:inference", f"key:{ALL_SCOPES}"]
EVERY_KEY = f"key:{ALL_SCOPES}"
READERS = {"owner", "approver", "developer", "viewer", "key:pipeline", "key:deploy", EVERY_KEY}
REGISTRARS = {"owner", "approver", "developer", "key:pipeline", EVERY_KEY}
DECIDERS = {"owner", "approver", "key:deploy", EVERY_KEY}

# (method, path) → (the principals that get through, the state r1 of adapter `bot` starts in, body);
# everybody else is refused with 403.
ALLOWED = {
    ("GET", "/api/v1/"): (READERS, None, None),
    ("GET", "/api/v1/audit/"): (READERS, None, None),
    ("GET", "/api/v1/keys/"): ({"owner"}, None, None),
    ("POST", "/api/v1/keys/"): ({"owner"}, None, {"name": "new", "scopes": ["inference"]}),
    ("DELETE", "/api/v1/keys/{prefix}/"): ({"owner"}, None, None),
    ("GET", "/api/v1/base-models/"): (READERS, None, None),
    ("GET", "/api/v1/adapters/"): (READERS, None, None),
    ("POST", "/api/v1/adapters/"): (REGISTRARS, None, {"name": "new-bot", "base_model": "roles-base"}),
    ("GET", "/api/v1/adapters/bot/"): (READERS, None, None),
    ("GET", "/api/v1/adapters/bot/revisions/"): (READERS, None, None),
    ("POST", "/api/v1/adapters/bot/revisions/"): (REGISTRARS, None, {"source_uri": "t/{tenant_id}/incoming/run/"}),
    ("GET", "/api/v1/adapters/bot/revisions/1/"): (READERS, "exported", None),
    ("POST", "/api/v1/adapters/bot/revisions/1/request-approval/"): (REGISTRARS, "exported", {}),
    ("POST", "/api/v1/adapters/bot/revisions/1/approve/"): (DECIDERS, "pending_approval", {}),
    ("POST", "/api/v1/adapters/bot/revisions/1/reject/"): (DECIDERS, "pending_approval", {"comment": "No."}),
    ("POST", "/api/v1/adapters/bot/revisions/1/retry/"): (REGISTRARS, "failed", {}),
    ("POST", "/api/v1/adapters/bot/activate/"): (DECIDERS, "approved", {"revision": "r1"}),
    ("POST", "/api/v1/adapters/bot/cancel/"): (DECIDERS, "approved", {"alias": "production"}),
}
SUCCESS = {"GET": 200, "POST": 200, "DELETE": 204}
CREATES = {"/api/v1/keys/", "/api/v1/adapters/", "/api/v1/adapters/bot/revisions/"}


def _call(world, artifact_root, client, method: str, path: str):
    """Set up what the endpoint needs (adapter `bot`, r1 in the row's state, an upload) and call it."""
    _, state, body = ALLOWED[(method, path)]
    victim, _ = world.key("inference")
    base = BaseModel.objects.create(name="roles-base", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=world.tenant, name="bot", base_model=base)
    if state:
        # A failed r1 failed for a reason worth retrying (a time limit); a cancel finds r1 pending on production.
        failure = "validation_timeout" if state == "failed" else ""
        r1 = AdapterRevision.objects.create(
            adapter=adapter, number=1, state=state, source_uri="x", failure_code=failure
        )
        adapter.revision_counter = 1
        adapter.save()
        if path.endswith("/cancel/"):
            Alias.objects.create(adapter=adapter, name="production", desired_revision=r1)
    incoming = artifact_root / f"t/{world.tenant.id}/incoming/run"
    incoming.mkdir(parents=True)
    (incoming / "adapter_config.json").write_text("{}")

    url = path.format(prefix=victim.prefix)
    data = None if body is None else json.dumps(body).replace("{tenant_id}", str(world.tenant.id))
    return client.generic(method, url, data=data, content_type="application/json")


@pytest.mark.parametrize("principal", ROLES + KEYS)
@pytest.mark.parametrize(("method", "path"), list(ALLOWED))
def test_role_and_scope_matrix(tenant_a, artifact_root, principal, method, path):
    allowed = ALLOWED[(method, path)][0]
    response = _call(tenant_a, artifact_root, tenant_a.client_as(principal), method, path)
    if principal in allowed:
        expected = 201 if method == "POST" and path in CREATES else SUCCESS[method]
        assert response.status_code == expected, response.content
    else:
        assert response.status_code == 403, response.content
        assert response.json()["error"]["code"] in {"forbidden", "insufficient_scope"}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(("method", "path"), list(ALLOWED))
def test_a_key_with_every_scope_does_what_its_creators_role_does_and_no_more(
    tenant_a, artifact_root, role, method, path
):
    """Keys follow people: scopes ∩ the creator's role. Managing keys stays with people (sessions)."""
    allowed = ALLOWED[(method, path)][0]
    creator = tenant_a.users[role]
    _, token = services.api_key_create(
        tenant=tenant_a.tenant, name="all", scopes=Scope.values, created_by=creator, by=Actor(user=creator)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = _call(tenant_a, artifact_root, client, method, path)
    if role in allowed and EVERY_KEY in allowed:
        expected = 201 if method == "POST" and path in CREATES else SUCCESS[method]
        assert response.status_code == expected, response.content
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
