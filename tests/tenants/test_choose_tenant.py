"""One rule decides which tenant a person's request acts for, on the REST API, the dashboard and its socket."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tenants.selectors import choose_tenant
from tests.factories import MembershipFactory

pytestmark = pytest.mark.django_db


def test_the_named_tenant_wins_then_the_only_one_then_none(tenant_a, tenant_b):
    person = tenant_a.users["viewer"]
    assert choose_tenant(user=person, named=None).membership.tenant == tenant_a.tenant  # the only one
    assert choose_tenant(user=person, named="acme").problem is None
    # Another tenant's slug and a slug nobody has are the same answer.
    assert choose_tenant(user=person, named="globex").problem == "not_member"
    assert choose_tenant(user=person, named="no-such").problem == "not_member"
    MembershipFactory(user=person, tenant=tenant_b.tenant, role="viewer")
    assert choose_tenant(user=person, named=None).problem == "ambiguous"
    assert choose_tenant(user=person, named="globex").membership.tenant == tenant_b.tenant
    assert choose_tenant(user=tenant_a.outsider, named=None).problem == "no_tenant"


def test_a_suspended_tenant_is_not_chosen(tenant_a):
    tenant_a.tenant.is_active = False
    tenant_a.tenant.save(update_fields=["is_active"])
    assert choose_tenant(user=tenant_a.users["owner"], named="acme").problem == "not_member"


def test_each_surface_answers_the_same_choice_its_way(tenant_a, tenant_b):
    person = tenant_a.users["viewer"]
    MembershipFactory(user=person, tenant=tenant_b.tenant, role="viewer")
    api = APIClient()
    api.force_login(person)
    assert api.get("/api/v1/adapters/").status_code == 400  # REST: name one with X-Mint-Tenant
    assert api.get("/api/v1/adapters/", HTTP_X_MINT_TENANT="globex").status_code == 200
    assert api.get("/api/v1/adapters/", HTTP_X_MINT_TENANT="nope").status_code == 404
    page = api.get("/")  # the dashboard: the chooser
    assert page.status_code == 200 and b"Choose a tenant" in page.content
