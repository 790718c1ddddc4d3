"""The Members page (owners: invite, change roles, remove, transfer ownership), the Settings page (the plan with
its use, the single sign-on policy) and `GET /api/v1/tenant/`, which shows the same plan rows."""

from __future__ import annotations

import pytest
from django.core import mail

from adapters.models import Adapter
from serving.models import Alias
from tenants.models import AuditEvent, IdentityProvider, Invitation, Membership, Tenant
from tests.conftest import error_of
from tests.frontend.conftest import page_client
from tests.tenants.test_admin_audit import change_tenant, saved, tenant_change_form

pytestmark = pytest.mark.django_db


def test_owner_invites_changes_a_role_and_removes_from_the_members_page(tenant_a):
    owner = page_client(tenant_a.users["owner"])
    page = owner.get("/members/")
    assert page.status_code == 200
    for role in ("owner", "approver", "developer", "viewer"):
        assert f'data-member="acme-{role}"'.encode() in page.content
    sent = owner.post("/members/", {"tenant": "acme", "who": "ada@example.com", "role": "approver"}, follow=True)
    assert b"Invitation sent to ada@example.com (approver)" in sent.content
    assert mail.outbox[0].to == ["ada@example.com"] and b"ada@example.com" in owner.get("/members/").content
    bad = owner.post("/members/", {"tenant": "acme", "who": "not an address", "role": "viewer"}, follow=True)
    assert b"No account named" in bad.content
    changed = owner.post("/members/acme-viewer/role/", {"tenant": "acme", "role": "developer"}, follow=True)
    assert b"acme-viewer is now developer." in changed.content
    removed = owner.post("/members/acme-developer/remove/", {"tenant": "acme"}, follow=True)
    assert b"acme-developer was removed from Acme" in removed.content
    roles = dict(Membership.objects.filter(tenant=tenant_a.tenant).values_list("user__username", "role"))
    assert roles == {"acme-owner": "owner", "acme-approver": "approver", "acme-viewer": "developer"}
    revoked = owner.post(f"/invitations/{Invitation.objects.get().id}/revoke/", {"tenant": "acme"}, follow=True)
    assert b"was revoked" in revoked.content and Invitation.objects.get().state == "revoked"


def test_the_page_says_why_the_last_owner_cannot_step_down(tenant_a):
    owner = page_client(tenant_a.users["owner"])
    answer = owner.post("/members/acme-owner/role/", {"tenant": "acme", "role": "viewer"}, follow=True)
    assert b"would have no owner left" in answer.content
    assert Membership.objects.get(user=tenant_a.users["owner"]).role == "owner"


def test_owner_transfers_ownership_from_the_page(tenant_a):
    owner = page_client(tenant_a.users["owner"])
    done = owner.post("/members/acme-approver/transfer/", {"tenant": "acme", "previous_role": "viewer"}, follow=True)
    assert b"acme-approver owns Acme now; you are viewer." in done.content
    assert Membership.objects.get(user=tenant_a.users["approver"]).role == "owner"
    assert Membership.objects.get(user=tenant_a.users["owner"]).role == "viewer"
    assert owner.get("/members/").status_code == 403


@pytest.mark.parametrize("role", ["approver", "developer", "viewer"])
def test_only_owners_see_and_use_the_members_page(tenant_a, role):
    client = page_client(tenant_a.users[role])
    assert client.get("/members/").status_code == 403
    assert client.post("/members/acme-viewer/role/", {"tenant": "acme", "role": "owner"}).status_code == 403
    assert client.post("/members/", {"tenant": "acme", "who": "x@example.com", "role": "owner"}).status_code == 403
    assert b'href="/members/"' not in client.get("/settings/").content
    assert Membership.objects.get(user=tenant_a.users["viewer"]).role == "viewer" and not Invitation.objects.exists()


def test_members_page_queries_do_not_grow_with_members(tenant_a, django_assert_max_num_queries):
    owner = page_client(tenant_a.users["owner"])
    owner.get("/members/")
    with django_assert_max_num_queries(14):
        owner.get("/members/")


# ---------------------------------------------------------------------------------------------
# The plan


def test_a_429_names_a_plan_field_the_settings_page_and_the_api_show_full(tenant_a, dense_base):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_api_keys=1, max_ready_revisions=2)
    tenant_a.key("pipeline")
    owner_api = tenant_a.client_as("owner")
    refused = owner_api.post("/api/v1/keys/", {"name": "more", "scopes": ["inference"]}, format="json")
    assert refused.status_code == 429
    field = error_of(refused)["detail"]["quota"]
    assert field == "max_api_keys"
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=dense_base)
    from tests.frontend.conftest import revision

    live = revision(adapter, 1, "approved")
    Alias.objects.create(adapter=adapter, name="production", revision=live, desired_revision=live, reserved=True)

    for principal in ("owner", "viewer", "key:pipeline"):
        body = tenant_a.client_as(principal).get("/api/v1/tenant/").json()
        rows = {row["field"]: row for row in body["plan"]}
        assert body["slug"] == "acme" and body["four_eyes"] is True and body["sso"] is None
        assert (rows[field]["limit"], rows[field]["used"], rows[field]["full"]) == (1, 1, True)
        assert rows["max_ready_revisions"]["per"] == {dense_base.name: 1}
        assert rows["max_ready_revisions"]["full"] is False
        assert rows["max_aliases_per_adapter"]["per"] == {"support-bot": 1}
        assert rows["max_adapters"]["used"] == 1 and rows["max_webhook_endpoints"]["used"] == 0
        assert rows["max_storage_bytes"]["unit"] == "bytes"
        assert rows["monthly_token_budget"]["unlimited"] is True and rows["monthly_token_budget"]["used"] == 0
        assert rows["max_request_tokens"]["used"] is None  # a bound on each request

    page = page_client(tenant_a.users["viewer"]).get("/settings/").content.decode()
    assert 'data-plan-field="max_api_keys" class="full"' in page
    assert "<code>max_ready_revisions</code>" in page and f"{dense_base.name}: 1" in page


def test_settings_shows_the_sso_binding_and_owners_set_who_joins(tenant_a):
    provider = IdentityProvider.objects.create(
        name="corp",
        issuer="https://login.acme.example",
        client_id="mint",
        authorization_endpoint="https://login.acme.example/authorize",
        token_endpoint="https://login.acme.example/token",
        userinfo_endpoint="https://login.acme.example/userinfo",
        jwks_uri="https://login.acme.example/jwks",
    )
    Tenant.objects.filter(id=tenant_a.tenant.id).update(sso_provider=provider)
    viewer_page = page_client(tenant_a.users["viewer"]).get("/settings/").content
    assert b"https://login.acme.example" in viewer_page and b"only people invited join" in viewer_page
    assert b"Save single sign-on policy" not in viewer_page
    owner = page_client(tenant_a.users["owner"])
    done = owner.post(
        "/settings/sso/", {"tenant": "acme", "sso_join": "default_role", "sso_default_role": "developer"}, follow=True
    )
    assert b"now join as developer" in done.content
    refused = owner.post(
        "/settings/sso/", {"tenant": "acme", "sso_join": "x", "sso_default_role": "owner"}, follow=True
    )
    assert b"sso_join must be one of" in refused.content
    tenant = Tenant.objects.get(id=tenant_a.tenant.id)
    assert (tenant.sso_join, tenant.sso_default_role) == ("default_role", "developer")
    event = AuditEvent.objects.get(action="tenant.sso")
    assert event.after == {"sso_join": "default_role", "sso_default_role": "developer"}
    assert page_client(tenant_a.users["approver"]).post("/settings/sso/", {"sso_join": "invitation"}).status_code == 403
    api = tenant_a.client_as("owner").get("/api/v1/tenant/").json()
    assert api["sso"] == {"issuer": "https://login.acme.example", "join": "default_role", "default_role": "developer"}


def test_staff_bind_a_tenant_to_an_issuer_in_the_admin(client, tenant_a):
    from tests.factories import UserFactory

    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    added = client.post(
        "/admin/tenants/identityprovider/add/",
        {
            "name": "corp",
            "issuer": "https://login.acme.example",
            "client_id": "mint",
            "client_secret": "s3cret",
            "authorization_endpoint": "https://login.acme.example/authorize",
            "token_endpoint": "https://login.acme.example/token",
            "userinfo_endpoint": "https://login.acme.example/userinfo",
            "jwks_uri": "https://login.acme.example/jwks",
            "signing_algorithm": "RS256",
            "scopes": "openid email profile",
        },
    )
    assert added.status_code == 302, added.content.decode()[:2000]
    provider = IdentityProvider.objects.get()
    assert provider.client_secret == "s3cret"
    assert b"s3cret" not in client.get(f"/admin/tenants/identityprovider/{provider.id}/change/").content
    form = tenant_change_form(tenant_a.tenant, sso_provider=provider.id, sso_join="default_role")
    saved(change_tenant(client, tenant_a.tenant, form))
    tenant = Tenant.objects.get(id=tenant_a.tenant.id)
    assert tenant.sso_provider_id == provider.id and tenant.sso_join == "default_role"
    event = AuditEvent.objects.get(action="tenant.sso")
    assert event.after == {"sso_provider_id": provider.id, "sso_join": "default_role"}
    assert not AuditEvent.objects.filter(action="tenant.update").exists()
