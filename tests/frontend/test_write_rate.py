"""Dashboard writes count against the person's API write rate (the tenant's api_write_rpm and its burst), the
same bucket as their REST API writes: a form is no way around the limit."""

from __future__ import annotations

import pytest

from tenants.throttles import burst_of

pytestmark = pytest.mark.django_db

CANCEL = "/adapters/support-bot/cancel/"


def test_the_burst_of_dashboard_writes_is_refused_with_the_limit_named(catalog_a, as_role, tenant_a):
    client = as_role("approver")
    burst = burst_of(tenant_a.tenant.api_write_rpm)
    for _ in range(burst):
        content = client.post(CANCEL, {"alias": "production"}, follow=True).content.decode()
        assert "API writes per minute" not in content
    content = client.post(CANCEL, {"alias": "production"}, follow=True).content.decode()
    assert f"over tenant {tenant_a.tenant.slug}&#x27;s limit of {tenant_a.tenant.api_write_rpm} API writes" in content


def test_a_script_sent_form_gets_a_429_json(catalog_a, as_role, tenant_a):
    client = as_role("approver")
    for _ in range(burst_of(tenant_a.tenant.api_write_rpm)):
        client.post(CANCEL, {"alias": "production"}, HTTP_X_REQUESTED_WITH="fetch")
    refused = client.post(CANCEL, {"alias": "production"}, HTTP_X_REQUESTED_WITH="fetch")
    assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"


def test_the_dashboard_and_the_api_share_one_bucket_per_person(catalog_a, as_role, tenant_a):
    client = as_role("approver")
    for _ in range(burst_of(tenant_a.tenant.api_write_rpm)):
        client.post(CANCEL, {"alias": "production"})
    api = tenant_a.client_as("approver")  # the same person, through the REST API
    response = api.post("/api/v1/adapters/support-bot/cancel/", {}, format="json")
    assert response.status_code == 429


def test_another_persons_writes_are_their_own(catalog_a, as_role, tenant_a):
    for _ in range(burst_of(tenant_a.tenant.api_write_rpm)):
        as_role("approver").post(CANCEL, {"alias": "production"})
    content = as_role("owner").post(CANCEL, {"alias": "production"}, follow=True).content.decode()
    assert "API writes per minute" not in content
