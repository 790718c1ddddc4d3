"""Hostile review of issue 18: a tenant's live API keys are bounded by its plan (`max_api_keys`).

Every gateway request is metered per key (serving/gateway/metering.py): each minute, hour and day a key has a
usage row per adapter, revision, node and status it met, refusals included (a 400, a 404, a 429 before any
node work). With keys unbounded, a tenant that made keys by the thousand and sent one refused request per key
and minute wrote thousands of rows a minute into the table every tenant shares (and as many counters into each
gateway's meter, and Redis counters for keys with budgets). The rows a minute a tenant can cause are now at
most its live keys (the plan's `max_api_keys`) times the few statuses a refusal has, plus what its served
revisions and nodes add.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from mint_site.errors import QuotaExceeded
from tenants import services
from tenants.access import Actor
from tenants.models import ApiKey, Tenant
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def create(client, name: str = "k"):
    return client.post("/api/v1/keys/", {"name": name, "scopes": ["inference"]}, format="json")


def test_a_tenant_cannot_make_keys_past_its_plan(tenant_a):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_api_keys=2)
    owner = tenant_a.client_as("owner")
    assert create(owner, "one").status_code == 201 and create(owner, "two").status_code == 201

    third = create(owner, "three")

    assert third.status_code == 429
    error = error_of(third)
    assert error["code"] == "key_quota_exceeded" and "max_api_keys=2" in error["message"]
    assert ApiKey.objects.filter(tenant=tenant_a.tenant).count() == 2


def test_revoked_and_expired_keys_leave_room_for_new_ones(tenant_a):
    tenant = tenant_a.tenant
    Tenant.objects.filter(id=tenant.id).update(max_api_keys=2)
    tenant.refresh_from_db()
    by = Actor(user=tenant_a.users["owner"])
    revoked, _ = services.api_key_create(tenant=tenant, name="old", scopes=["inference"], created_by=None, by=by)
    services.api_key_revoke(key=revoked, by=by)
    expired, _ = services.api_key_create(tenant=tenant, name="gone", scopes=["inference"], created_by=None, by=by)
    ApiKey.objects.filter(id=expired.id).update(expires_at=timezone.now() - timedelta(seconds=1))

    services.api_key_create(tenant=tenant, name="a", scopes=["inference"], created_by=None, by=by)
    services.api_key_create(tenant=tenant, name="b", scopes=["inference"], created_by=None, by=by)
    with pytest.raises(QuotaExceeded):
        services.api_key_create(tenant=tenant, name="c", scopes=["inference"], created_by=None, by=by)


def test_one_tenants_keys_leave_the_others_quota_alone(tenant_a, tenant_b):
    Tenant.objects.filter(id__in=[tenant_a.tenant.id, tenant_b.tenant.id]).update(max_api_keys=1)
    assert create(tenant_a.client_as("owner")).status_code == 201

    assert create(tenant_b.client_as("owner")).status_code == 201
