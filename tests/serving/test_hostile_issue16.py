"""Hostile review of issue 16's serving additions: pending-activation reasons on the REST API."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent():
    with (
        recorded(*NODE_TASKS, "alias_converge"),
    ):
        yield


def _pending_adapters(tenant, base, start: int, count: int) -> None:
    for i in range(start, start + count):
        adapter = Adapter.objects.create(tenant=tenant, name=f"bot-{i}", base_model=base)
        live, wanted = (
            AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x") for n in (1, 2)
        )
        Alias.objects.create(adapter=adapter, name="production", revision=live, desired_revision=wanted)


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("url", ["/api/v1/adapters/", "/"])
def test_listing_pending_activations_costs_a_fixed_number_of_queries(tenant_a, dense_base, node, url):
    """The API's list leaves the reasons to each adapter's own page; the dashboard's overview explains a bounded
    number of them (serving.selectors.activation_status costs a few queries per pending alias)."""
    client = tenant_a.client_as("viewer")
    _pending_adapters(tenant_a.tenant, dense_base, 0, 12)  # more than the overview explains
    few = _queries(client, url)
    _pending_adapters(tenant_a.tenant, dense_base, 12, 30)
    many = _queries(client, url)
    assert many <= few + 2, (few, many)
