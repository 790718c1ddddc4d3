"""Evaluations on the usage page and in the usage API (`kind=evaluation`): the tenant's own suites run on the
nodes are its traffic, billed, shown apart from applications' calls; another tenant's never."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving.models import UsageKind
from tests.frontend.conftest import page_client
from tests.frontend.test_usage_page import chart_data
from tests.frontend.test_usage_sampling import meter

pytestmark = pytest.mark.django_db


@pytest.fixture
def traffic(tenant_a, tenant_b, adapter_a, adapter_b):
    at = timezone.now() - timedelta(minutes=5)
    meter(tenant_a.tenant, adapter_a.name, at=at, requests=2, adapter_id=adapter_a.id)
    meter(
        tenant_a.tenant,
        adapter_a.name,
        at=at,
        revision=3,
        requests=60,
        prompt=20,
        completion=200,
        adapter_id=adapter_a.id,
        kind=UsageKind.EVALUATION,
    )
    meter(tenant_b.tenant, adapter_b.name, at=at, revision=1, requests=9, kind=UsageKind.EVALUATION)


def test_the_usage_page_shows_evaluations_apart(traffic, tenant_a):
    client = page_client(tenant_a.users["viewer"])
    inference = chart_data(client.get("/usage/"))
    page = client.get("/usage/?kind=evaluation")
    evaluations = chart_data(page)
    assert inference["totals"]["requests"] == 2
    assert (evaluations["kind"], evaluations["totals"]["requests"], evaluations["totals"]["total_tokens"]) == (
        "evaluation",
        60,
        60 * 220,
    )
    html = page.content.decode()
    assert "evaluation suites' cases" in html and 'value="evaluation" selected' in html


def test_the_usage_api_reports_evaluations(traffic, tenant_a):
    response = tenant_a.client_as("key:pipeline").get("/api/v1/usage/", {"kind": "evaluation"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["totals"]["requests"] == 60  # tenant B's nine are not tenant A's
