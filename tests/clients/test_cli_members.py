"""`mint members list|invite|role|remove` through `main(argv)` against the live app, on the session `mint login`
keeps: an owner manages people from the command line; the invitation goes out by mail."""

from __future__ import annotations

import pytest
from django.core import mail

from tenants.models import Invitation, Membership
from tests.clients.test_cli_keys import config_dir, login, mint  # noqa: F401  (fixtures)
from tests.factories import PASSWORD


@pytest.fixture
def locmem_mail(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return mail


def test_owner_lists_invites_changes_and_removes_members(mint, locmem_mail, tenant_a):  # noqa: F811
    assert login(mint)[0] == 0
    code, people = mint("members", "list")
    assert code == 0 and {m["username"]: m["role"] for m in people}["acme-viewer"] == "viewer"

    code, invitation = mint("members", "invite", "ada@example.com", "--role", "approver")
    assert code == 0 and invitation["email"] == "ada@example.com" and invitation["role"] == "approver"
    assert locmem_mail.outbox[0].to == ["ada@example.com"]
    assert Invitation.objects.get(tenant=tenant_a.tenant).state == "pending"

    code, member = mint("members", "role", "acme-viewer", "developer")
    assert code == 0 and member["role"] == "developer"
    assert Membership.objects.get(tenant=tenant_a.tenant, user__username="acme-viewer").role == "developer"

    code, out = mint("members", "remove", "acme-developer")
    assert code == 0 and out == {"removed": "acme-developer"}
    assert not Membership.objects.filter(tenant=tenant_a.tenant, user__username="acme-developer").exists()


def test_the_last_owner_cannot_step_down_from_the_cli(mint, tenant_a):  # noqa: F811
    assert login(mint)[0] == 0
    code, _, err = mint("members", "role", "acme-owner", "viewer", json_out=False)
    assert code != 0 and "no owner left" in err
    assert Membership.objects.get(tenant=tenant_a.tenant, user__username="acme-owner").role == "owner"


def test_a_non_owner_is_refused(mint, tenant_a):  # noqa: F811
    assert login(mint, "acme-approver", PASSWORD)[0] == 0
    code, _, err = mint("members", "list", json_out=False)
    assert code != 0 and "does not allow this" in err
