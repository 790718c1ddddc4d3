"""Pinned query counts: each page costs the same number of queries however many rows it shows."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenants.access import Actor
from tenants.services import api_key_create
from tests.frontend.conftest import fill, page_client

pytestmark = pytest.mark.django_db

# session, user, memberships: every signed-in page; then the page's own reads.
EXPECTED = {
    # adapters, aliases, readiness; nodes with tier counts, own placements, disk bytes; base models (the create form)
    "/": 3 + 6 + 1,
    # adapter, aliases, newest evaluation suite; revisions: count, page, approvals, placements
    "/adapters/support-bot/": 3 + 3 + 4,
    "/adapters/support-bot/?fragment=revisions": 3 + 3 + 4,
    "/adapters/support-bot/?state=approved": 3 + 3 + 4,
    "/adapters/support-bot/revisions/2/": 3 + 3 + 4,  # the revision's own page: the same reads, one revision
    "/nodes/": 3 + 3,  # nodes with tier counts, own placements, disk bytes
    "/audit/": 3 + 3,  # count, page, actions for the filter
    "/audit/?since=2000-01-01&until=2999-01-01": 3 + 3,
    "/keys/": 3 + 2,  # count, page (created_by joined)
}

# A search, a page further on, a state filter: the overview's reads, each narrowed in SQL. A search of three letters
# or more first reads the tenant's newest names (is the term common?), then a rare term's matches' ids.
EXPECTED |= {
    "/?q=SUPPORT": EXPECTED["/"] + 2,
    "/?q=bot&after=999999999": EXPECTED["/"] + 2,
    "/?before=1&state=awaiting": EXPECTED["/"],
}


def many_keys(world, n: int) -> None:
    for i in range(n):
        api_key_create(
            tenant=world.tenant, name=f"k{i}", scopes=["inference"], created_by=world.users["owner"], by=Actor.system()
        )


@pytest.mark.parametrize("url", list(EXPECTED))
def test_page_query_count_is_pinned(tenant_a, adapter_a, node, django_assert_num_queries, url):
    fill(tenant_a, adapter_a, node, extra=12)
    many_keys(tenant_a, 12)
    client = page_client(tenant_a.users["owner"])
    client.get("/")  # the first request stores the tenant in the session
    with django_assert_num_queries(EXPECTED[url]):
        assert client.get(url).status_code == 200


@pytest.mark.parametrize("url", list(EXPECTED))
def test_page_query_count_does_not_grow_with_rows(tenant_a, adapter_a, node, url):
    client = page_client(tenant_a.users["owner"])
    counts = []
    for extra in (0, 15):
        if extra:
            from adapters.models import Adapter

            for i in range(extra):
                other = Adapter.objects.create(
                    tenant=tenant_a.tenant, name=f"more-{i}", base_model=adapter_a.base_model
                )
                fill(tenant_a, other, node, extra=2)
            many_keys(tenant_a, extra)
        else:
            fill(tenant_a, adapter_a, node)
            many_keys(tenant_a, 1)
        client.get("/")
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200
        counts.append(len(queries))
    assert counts[0] == counts[1], counts
