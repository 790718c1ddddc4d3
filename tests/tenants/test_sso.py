"""Single sign-on through a real OpenID Connect provider running in its own process (tests/oidc_provider/):
people of the tenant's issuer sign in, join with the default role or only by invitation, and tokens with a
forged signature, from another issuer or for another audience are refused with a page that says why."""

from __future__ import annotations

import pytest
from django.core import mail
from django.test import Client

from tenants import members
from tenants.access import Actor
from tenants.models import IdentityProvider, Invitation, Membership, SsoIdentity, Tenant
from tests.oidc_provider.fixtures import oidc_provider  # noqa: F401  (the provider, one per session)

pytestmark = pytest.mark.django_db


def bind(tenant: Tenant, provider, client: str, *, join: str = "default_role", role: str = "developer") -> None:
    """Register MinT as `client` at the provider, and bind `tenant` to it."""
    idp, _ = IdentityProvider.objects.update_or_create(
        name=f"idp-{client}",
        defaults={"client_id": client, "client_secret": provider.secret_of(client), **provider.endpoints()},
    )
    Tenant.objects.filter(id=tenant.id).update(sso_provider=idp, sso_join=join, sso_default_role=role)


def who(client: Client) -> dict:
    return client.get("/api/v1/").json()


def test_a_person_of_the_issuer_signs_in_and_joins_with_the_default_role(tenant_a, oidc_provider):  # noqa: F811
    bind(tenant_a.tenant, oidc_provider, "mint", role="developer")
    browser = Client()
    done = oidc_provider.sign_in(browser, "acme", "ada")
    assert done.status_code == 302 and done["Location"] == "/", done.content[:500]
    assert who(browser) == who(browser) | {"tenant": "acme", "principal": "ada", "role": "developer"}
    identity = SsoIdentity.objects.get()
    assert identity.user.email == "ada@idp.example" and not identity.user.has_usable_password()
    # Signing in again finds the same account (matched by issuer and subject, not by email).
    again = Client()
    assert oidc_provider.sign_in(again, "acme", "ada").status_code == 302
    assert SsoIdentity.objects.count() == 1 and who(again)["principal"] == "ada"
    # A deactivated account's single sign-on session ends with it.
    identity.user.is_active = False
    identity.user.save(update_fields=["is_active"])
    assert again.get("/api/v1/").status_code in (401, 403)


def test_invitation_only_tenant_refuses_strangers_and_admits_the_invited(tenant_a, oidc_provider):  # noqa: F811
    bind(tenant_a.tenant, oidc_provider, "mint", join="invitation")
    refused = oidc_provider.sign_in(Client(), "acme", "eve")
    assert refused.status_code == 403
    assert b"only by invitation" in refused.content and b"eve@idp.example" in refused.content
    assert not SsoIdentity.objects.exists() and not Membership.objects.filter(user__username="eve").exists()

    owner = tenant_a.users["owner"]
    members.member_invite(
        tenant=tenant_a.tenant, role="approver", email="eve@idp.example", by=Actor(user=owner), site_url="http://t"
    )
    assert mail.outbox[0].to == ["eve@idp.example"]
    browser = Client()
    assert oidc_provider.sign_in(browser, "acme", "eve").status_code == 302
    assert who(browser)["role"] == "approver"
    assert Invitation.objects.get().state == Invitation.State.ACCEPTED


@pytest.mark.parametrize(
    ("client", "says"),
    [
        ("forger", b"signature does not verify with the keys"),
        ("other-issuer", b"was issued by &#x27;http://other-issuer.invalid&#x27;"),
        ("wrong-audience", b"meant for [&#x27;another-application&#x27;], not for MinT"),
    ],
)
def test_a_token_with_a_forged_signature_another_issuer_or_audience_is_refused(
    tenant_a,
    oidc_provider,  # noqa: F811
    client,
    says,
):
    bind(tenant_a.tenant, oidc_provider, client)
    browser = Client()
    refused = oidc_provider.sign_in(browser, "acme", "ada")
    assert refused.status_code == 403, refused.content[:500]
    assert says in refused.content, refused.content.decode()[:2000]
    assert browser.get("/api/v1/").status_code in (401, 403)  # nobody is signed in
    assert not SsoIdentity.objects.exists() and not Membership.objects.filter(user__username="ada").exists()


def test_a_tenant_without_single_sign_on_has_none(tenant_a, tenant_b, oidc_provider):  # noqa: F811
    bind(tenant_a.tenant, oidc_provider, "mint")
    for slug in ("globex", "no-such-tenant"):
        answer = Client().get(f"/sso/{slug}/")
        assert answer.status_code == 404 and b"No single sign-on is set up for this tenant." in answer.content
    # A sign-in started for tenant A makes nobody a member of B.
    browser = Client()
    assert oidc_provider.sign_in(browser, "acme", "ada").status_code == 302
    assert not Membership.objects.filter(tenant=tenant_b.tenant, user__username="ada").exists()
    assert browser.get("/api/v1/", HTTP_X_MINT_TENANT="globex").status_code == 404


def test_refused_sign_ins_through_the_issuer_never_lock_out_the_address(tenant_a, oidc_provider, settings):  # noqa: F811
    # The callback checks no password (the issuer did): django-axes neither counts nor locks it out.
    bind(tenant_a.tenant, oidc_provider, "wrong-audience")
    for _ in range(settings.AXES_FAILURE_LIMIT + 1):
        assert oidc_provider.sign_in(Client(), "acme", "ada").status_code == 403
    bind(tenant_a.tenant, oidc_provider, "mint")
    assert oidc_provider.sign_in(Client(), "acme", "ada").status_code == 302
