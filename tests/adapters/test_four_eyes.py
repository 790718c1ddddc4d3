"""Four-eyes, per role and per key scope: nobody approves what they (or a key they created) registered,
and a key without an owner (an operator's, from `mint_key create`) is nobody: it never decides."""

from __future__ import annotations

import pytest

from adapters.models import AdapterRevision, Approval
from tenants import services as tenant_services
from tenants.access import Actor
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/1"


def pending(adapter, *, user=None, key=None) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter, number=1, state="pending_approval", source_uri="x", created_by=user, created_by_key=key
    )


def key_made_by(world, user, *scopes):
    return tenant_services.api_key_create(
        tenant=world.tenant, name="k", scopes=scopes, created_by=user, by=Actor(user=user)
    )


def approve_with_token(token: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post(f"{URL}/approve/", {}, format="json")


@pytest.mark.parametrize("role", ["approver", "owner"])
def test_a_person_cannot_approve_their_own_revision(tenant_a, adapter_a, role):
    revision = pending(adapter_a, user=tenant_a.users[role])
    response = tenant_a.client_as(role).post(f"{URL}/approve/", {}, format="json")
    assert response.status_code == 403
    assert error_of(response)["code"] == "four_eyes"
    revision.refresh_from_db()
    assert revision.state == "pending_approval"
    assert not Approval.objects.exists()


@pytest.mark.parametrize("role", ["approver", "owner"])
def test_another_approver_or_owner_can_approve(tenant_a, adapter_a, role):
    pending(adapter_a, user=tenant_a.users["developer"])
    response = tenant_a.client_as(role).post(f"{URL}/approve/", {"comment": "ok"}, format="json")
    assert response.status_code == 200, response.content
    assert Approval.objects.get().decided_by == tenant_a.users[role]


@pytest.mark.parametrize("role", ["developer", "viewer"])
def test_roles_below_approver_cannot_decide(tenant_a, adapter_a, role):
    pending(adapter_a, user=tenant_a.users["owner"])
    for action in ("approve", "reject"):
        response = tenant_a.client_as(role).post(f"{URL}/{action}/", {}, format="json")
        assert response.status_code == 403
        assert error_of(response)["code"] == "forbidden"


def test_pipeline_key_cannot_decide_and_deploy_key_cannot_register(tenant_a, adapter_a):
    pending(adapter_a, user=tenant_a.users["developer"])
    refused = tenant_a.client_as("key:pipeline").post(f"{URL}/approve/", {}, format="json")
    assert refused.status_code == 403 and error_of(refused)["code"] == "insufficient_scope"
    register = tenant_a.client_as("key:deploy").post(
        "/api/v1/adapters/support-bot/revisions/", {"source_uri": "t/1/incoming/x"}, format="json"
    )
    assert register.status_code == 403 and error_of(register)["code"] == "insufficient_scope"


def test_a_key_acts_as_the_person_who_created_it(tenant_a, adapter_a):
    approver = tenant_a.users["approver"]
    pipeline_key, _ = key_made_by(tenant_a, approver, "pipeline")
    _, deploy_token = key_made_by(tenant_a, approver, "deploy")
    pending(adapter_a, key=pipeline_key)
    # The approver's own deploy key may not approve what the approver's pipeline key registered …
    response = approve_with_token(deploy_token)
    assert response.status_code == 403 and error_of(response)["code"] == "four_eyes"
    # … nor may the approver in person.
    response = tenant_a.client_as("approver").post(f"{URL}/approve/", {}, format="json")
    assert response.status_code == 403 and error_of(response)["code"] == "four_eyes"
    # The owner may.
    assert tenant_a.client_as("owner").post(f"{URL}/approve/", {}, format="json").status_code == 200


def test_one_key_with_both_scopes_cannot_approve_its_own_registration(tenant_a, adapter_a):
    key, token = key_made_by(tenant_a, tenant_a.users["owner"], "pipeline", "deploy")
    pending(adapter_a, key=key)
    response = approve_with_token(token)
    assert response.status_code == 403 and error_of(response)["code"] == "four_eyes"


def test_deploy_key_of_someone_else_can_approve(tenant_a, adapter_a):
    _, token = key_made_by(tenant_a, tenant_a.users["owner"], "deploy")
    pending(adapter_a, user=tenant_a.users["developer"])
    response = approve_with_token(token)
    assert response.status_code == 200, response.content
    assert Approval.objects.get().decided_by_key.scopes == ["deploy"]


def test_the_owner_can_relax_four_eyes_for_the_tenant(tenant_a, adapter_a):
    tenant_a.tenant.four_eyes = False
    tenant_a.tenant.save()
    pending(adapter_a, user=tenant_a.users["approver"])
    assert tenant_a.client_as("approver").post(f"{URL}/approve/", {}, format="json").status_code == 200


def test_four_eyes_also_guards_reject(tenant_a, adapter_a):
    pending(adapter_a, user=tenant_a.users["approver"])
    response = tenant_a.client_as("approver").post(f"{URL}/reject/", {}, format="json")
    assert response.status_code == 403 and error_of(response)["code"] == "four_eyes"


# ---------------------------------------------------------------------------------------------
# A key without an owner is nobody


def ownerless_key(world, *scopes: str):
    """A key made by an operator (`mint_key create` without --user): it has no creator."""
    return tenant_services.api_key_create(
        tenant=world.tenant, name="ops", scopes=scopes, created_by=None, by=Actor.system()
    )


def decide_with_token(token: str, action: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post(f"{URL}/{action}/", {}, format="json")


@pytest.mark.parametrize("action", ["approve", "reject"])
def test_an_ownerless_key_cannot_decide_under_four_eyes(tenant_a, adapter_a, action):
    _, token = ownerless_key(tenant_a, "deploy")
    pending(adapter_a, user=tenant_a.users["developer"])
    response = decide_with_token(token, action)
    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "four_eyes"
    assert "without an owner" in error["message"] and "created by a person" in error["message"]
    assert not Approval.objects.exists()


def test_two_ownerless_keys_are_not_two_people(tenant_a, adapter_a):
    registrar, _ = ownerless_key(tenant_a, "pipeline")
    _, decider = ownerless_key(tenant_a, "deploy")
    AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state="pending_approval", source_uri="x", created_by_key=registrar
    )
    response = decide_with_token(decider, "approve")
    assert response.status_code == 403 and error_of(response)["code"] == "four_eyes"
    # A person may decide what an ownerless key registered: it was registered by nobody.
    assert tenant_a.client_as("approver").post(f"{URL}/approve/", {}, format="json").status_code == 200


def test_an_ownerless_key_decides_where_four_eyes_is_off(tenant_a, adapter_a):
    tenant_a.tenant.four_eyes = False
    tenant_a.tenant.save()
    _, token = ownerless_key(tenant_a, "deploy")
    pending(adapter_a, user=tenant_a.users["developer"])
    assert decide_with_token(token, "approve").status_code == 200
