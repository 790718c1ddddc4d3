"""Keys follow people: a key does at most what its creator may do now in the key's tenant, and every
change to that is announced to the gateways (`api_key.changed`) once committed."""

from __future__ import annotations

from io import StringIO
from unittest import mock

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.management import call_command
from rest_framework.test import APIClient

from adapters.models import AdapterRevision, Approval
from tenants import services
from tenants.access import ROLE_CAPABILITIES, Actor, Capability
from tenants.auth import authenticate_token
from tenants.models import ApiKey, Role
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/1"


def key_of(world, role: str, *scopes: str) -> tuple[ApiKey, str]:
    user = world.users[role]
    return services.api_key_create(
        tenant=world.tenant, name=f"{role}-key", scopes=scopes, created_by=user, by=Actor(user=user)
    )


def bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def pending(adapter, *, user) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter, number=1, state="pending_approval", source_uri="x", created_by=user
    )


# ---------------------------------------------------------------------------------------------
# Rights: scopes ∩ the creator's current role


def test_every_role_may_run_inference_and_nothing_else_changed():
    for role, capabilities in ROLE_CAPABILITIES.items():
        assert Capability.INFERENCE in capabilities, role
    # Sampling (any exported revision by adapter@rN) comes with registering: whoever may register may read back.
    assert [role for role, caps in ROLE_CAPABILITIES.items() if Capability.SAMPLE in caps] == [
        Role.DEVELOPER,
        Role.APPROVER,
        Role.OWNER,
    ]
    without = {role: caps - {Capability.INFERENCE, Capability.SAMPLE} for role, caps in ROLE_CAPABILITIES.items()}
    assert without == {
        Role.VIEWER: {Capability.READ},
        Role.DEVELOPER: {Capability.READ, Capability.REGISTER},
        Role.APPROVER: {Capability.READ, Capability.REGISTER, Capability.DECIDE},
        Role.OWNER: {
            Capability.READ,
            Capability.REGISTER,
            Capability.DECIDE,
            Capability.MANAGE_KEYS,
            Capability.MANAGE_WEBHOOKS,
            Capability.MANAGE_MEMBERS,
        },
    }


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        ("owner", ["decide", "inference", "read", "register", "sample"]),
        ("approver", ["decide", "inference", "read", "register", "sample"]),
        ("developer", ["inference", "read", "register", "sample"]),
        ("viewer", ["inference", "read"]),
    ],
)
def test_a_keys_capabilities_are_its_scopes_narrowed_to_its_creators_role(tenant_a, role, expected):
    _, token = key_of(tenant_a, role, "inference", "pipeline", "deploy")
    response = bearer(token).get("/api/v1/")
    assert response.status_code == 200, response.content
    assert response.json()["capabilities"] == expected


def test_a_key_without_a_creator_keeps_its_scopes(tenant_a):
    out = StringIO()
    call_command("mint_key", "create", "--tenant", "acme", "--scopes", "inference,pipeline,deploy", stdout=out)
    response = bearer(out.getvalue().strip()).get("/api/v1/")
    assert response.json()["capabilities"] == ["decide", "inference", "read", "register", "sample"]


def test_a_developers_deploy_key_cannot_approve(tenant_a, adapter_a):
    _, token = key_of(tenant_a, "developer", "deploy")
    pending(adapter_a, user=tenant_a.users["owner"])
    response = bearer(token).post(f"{URL}/approve/", {}, format="json")
    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "forbidden"
    assert "acme-developer" in error["message"] and "no longer allows" in error["message"]


def test_a_demoted_approvers_deploy_key_can_no_longer_approve(tenant_a, adapter_a):
    approver = tenant_a.users["approver"]
    _, token = key_of(tenant_a, "approver", "deploy")
    pending(adapter_a, user=tenant_a.users["developer"])
    services.membership_set(tenant=tenant_a.tenant, user=approver, role=Role.DEVELOPER, by=Actor.system())

    response = bearer(token).post(f"{URL}/approve/", {}, format="json")

    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "forbidden"
    assert "creator" in error["message"] and "now developer" in error["message"]
    assert "no longer allows" in error["message"]
    assert not Approval.objects.exists()
    # Promoted again, the same key approves.
    services.membership_set(tenant=tenant_a.tenant, user=approver, role=Role.APPROVER, by=Actor.system())
    assert bearer(token).post(f"{URL}/approve/", {}, format="json").status_code == 200


def test_a_removed_members_key_is_refused_with_401_naming_the_key(tenant_a):
    key, token = key_of(tenant_a, "developer", "pipeline")
    assert bearer(token).get("/api/v1/").status_code == 200
    services.membership_remove(tenant=tenant_a.tenant, user=tenant_a.users["developer"], by=Actor.system())

    response = bearer(token).get("/api/v1/")

    assert response.status_code == 401
    error = error_of(response)
    assert error["code"] == "api_key_owner_inactive"
    assert f"mint_{key.prefix}_" in error["message"]
    assert "no longer has access" in error["message"] and "ask an owner" in error["message"]
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_a_member_of_another_tenant_only_is_no_owner_of_this_tenants_key(tenant_a, tenant_b):
    # The creator's role is read in the key's tenant, not in any tenant they belong to.
    person = tenant_a.users["approver"]
    _, token = key_of(tenant_a, "approver", "deploy")
    services.membership_set(tenant=tenant_b.tenant, user=person, role=Role.OWNER, by=Actor.system())
    services.membership_remove(tenant=tenant_a.tenant, user=person, by=Actor.system())
    assert error_of(bearer(token).get("/api/v1/"))["code"] == "api_key_owner_inactive"


def test_a_deactivated_persons_key_is_refused_until_they_are_reactivated(tenant_a):
    person = tenant_a.users["approver"]
    _, token = key_of(tenant_a, "approver", "deploy")
    person.is_active = False
    person.save()
    assert error_of(bearer(token).get("/api/v1/"))["code"] == "api_key_owner_inactive"
    person.is_active = True
    person.save()
    assert bearer(token).get("/api/v1/").status_code == 200


def test_deleting_a_person_revokes_their_keys_rather_than_leaving_them_ownerless(tenant_a):
    key, token = key_of(tenant_a, "approver", "deploy")
    tenant_a.users["approver"].delete()
    key.refresh_from_db()
    assert key.created_by is None and key.revoked_at is not None
    assert error_of(bearer(token).get("/api/v1/"))["code"] == "api_key_revoked"


def test_resolving_a_key_and_its_creators_role_is_one_query(tenant_a, django_assert_num_queries):
    key, token = key_of(tenant_a, "approver", "deploy")
    authenticate_token(token)  # the first use also writes last_used_at
    with django_assert_num_queries(1):
        resolved = authenticate_token(token)
    assert resolved.id == key.id and resolved.creator_role == Role.APPROVER


def test_a_key_request_pins_its_query_count(tenant_a, django_assert_num_queries):
    _, token = key_of(tenant_a, "developer", "pipeline")
    client = bearer(token)
    client.get("/api/v1/audit/")
    # the key with its tenant, creator and creator's role + the page of audit events
    with django_assert_num_queries(2):
        assert client.get("/api/v1/audit/").status_code == 200


# ---------------------------------------------------------------------------------------------
# Announcing changes to the gateways


@pytest.fixture
def sent():
    """The `api_key.changed` events sent (after commit) while the test runs: (tenant_id, event) pairs."""
    events: list[tuple[int | None, dict]] = []

    def record(groups, event, tenant_id=None):
        if event["type"] == services.API_KEY_CHANGED:
            events.append((tenant_id, event))

    with mock.patch("mint_site.events._send", side_effect=record):
        yield events


def _changes(events) -> list[tuple[int | None, str, int | None]]:
    return [(tenant_id, event["state"], event["key"]) for tenant_id, event in events]


def test_revoking_a_key_announces_that_key_after_commit(tenant_a, sent, django_capture_on_commit_callbacks):
    key, _ = key_of(tenant_a, "owner", "inference")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.api_key_revoke(key=key, by=Actor.system())
        assert sent == []  # not before commit
    for callback in callbacks:
        callback()
    assert _changes(sent) == [(tenant_a.tenant.id, "revoked", key.id)]

    with django_capture_on_commit_callbacks(execute=True):
        services.api_key_revoke(key=key, by=Actor.system())  # already revoked: nothing changes
    assert len(sent) == 1


def test_membership_changes_announce_the_tenant(tenant_a, tenant_b, sent, django_capture_on_commit_callbacks):
    person, tenant = tenant_b.outsider, tenant_a.tenant
    with django_capture_on_commit_callbacks(execute=True):
        services.membership_set(tenant=tenant, user=person, role=Role.VIEWER, by=Actor.system())
        services.membership_set(tenant=tenant, user=person, role=Role.VIEWER, by=Actor.system())  # no change
        services.membership_set(tenant=tenant, user=person, role=Role.APPROVER, by=Actor.system())
        services.membership_remove(tenant=tenant, user=person, by=Actor.system())
    assert _changes(sent) == [(tenant.id, "membership", None)] * 3


def test_deactivating_a_person_announces_each_tenant_of_their_keys(
    tenant_a, tenant_b, sent, django_capture_on_commit_callbacks
):
    person = tenant_a.users["approver"]
    services.membership_set(tenant=tenant_b.tenant, user=person, role=Role.VIEWER, by=Actor.system())
    with django_capture_on_commit_callbacks(execute=True):
        person.first_name = "Ada"
        person.save()  # nothing that matters to keys
        person.is_active = False
        person.save()
        person.save()  # saved again, still inactive: no second announcement
    assert sorted(_changes(sent)) == sorted(
        [(tenant_a.tenant.id, "person", None), (tenant_b.tenant.id, "person", None)]
    )

    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        reloaded = type(person).objects.get(id=person.id)
        reloaded.is_active = True
        reloaded.save(update_fields=["is_active"])
    assert len(sent) == 2


def test_suspending_a_tenant_announces_it(tenant_a, sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        services.tenant_update(tenant=tenant_a.tenant, changes={"max_adapters": 5}, by=Actor.system())
        services.tenant_update(tenant=tenant_a.tenant, changes={"is_active": False}, by=Actor.system())
    assert _changes(sent) == [(tenant_a.tenant.id, "tenant", None)]


# ---------------------------------------------------------------------------------------------
# The dashboard: the event reaches only its tenant's members (and staff, without names)


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_socket_does_not_show_a_key_event_to_another_tenant(tenant_a, tenant_b):
    from tests.factories import UserFactory
    from tests.frontend.test_live_events import EVENT_S, QUIET_S, communicator

    key, _ = key_of(tenant_a, "owner", "inference")
    staff = UserFactory(username="ops", is_staff=True)
    own, other, platform = (
        communicator(tenant_a.users["viewer"]),
        communicator(tenant_b.users["owner"]),
        communicator(staff),
    )

    async def scenario():
        for ws in (own, other, platform):
            assert (await ws.connect())[0]
        await sync_to_async(services.api_key_revoke)(key=key, by=Actor.system())
        seen = await own.receive_json_from(timeout=EVENT_S), await platform.receive_json_from(timeout=EVENT_S)
        nothing = await other.receive_nothing(QUIET_S)
        for ws in (own, other, platform):
            await ws.disconnect()
        return seen, nothing

    (mine, staffs), nothing_for_others = async_to_sync(scenario)()
    assert nothing_for_others
    assert mine["type"] == "api_key.changed" and mine["key"] == key.id and mine["state"] == "revoked"
    assert set(staffs) == {"type", "id", "state", "at"}  # another tenant's event: no names, no key field
