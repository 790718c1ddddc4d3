"""Sampling shown apart from applications' calls: the usage page's traffic switch, its CSV, and the usage API's
`kind=sampling` (rows as the gateway's flush writes them)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving import services as serving_services
from serving.models import USAGE_COUNTS, UsageKind
from tests.frontend.conftest import page_client
from tests.frontend.test_usage_page import chart_data, csv_rows

pytestmark = pytest.mark.django_db


def meter(tenant, adapter_name, *, at, revision=2, status=200, requests=1, prompt=10, completion=5, **key) -> None:
    """`requests` requests of `adapter_name`@r`revision` in the minute of `at` (30 ms each), as a flush adds them."""
    values = [0.0] * len(USAGE_COUNTS)
    values[:4] = [requests, prompt * requests, completion * requests, 30.0 * requests]
    values[USAGE_COUNTS.index("lat_2")] = requests  # 25-50 ms
    minute = at.replace(second=0, microsecond=0)
    kind, adapter_id = key.get("kind", UsageKind.INFERENCE), key.get("adapter_id", 1)
    serving_services.usage_add(
        counts={(minute, kind, tenant.id, 0, adapter_id, adapter_name, revision, "node-1", status): values}
    )


@pytest.fixture
def traffic(tenant_a, tenant_b, adapter_a, adapter_b):
    """Tenant A: support-bot r2 called by applications (2 requests), r5 sampled by its pipeline (4 requests, one
    of them a 503 while r5 loaded). Tenant B samples too."""
    at = timezone.now() - timedelta(minutes=5)
    a = tenant_a.tenant
    meter(a, adapter_a.name, at=at, requests=2, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=at, revision=5, requests=3, prompt=7, completion=64, kind=UsageKind.SAMPLING)
    meter(a, adapter_a.name, at=at, revision=5, status=503, prompt=0, completion=0, kind=UsageKind.SAMPLING)
    meter(tenant_b.tenant, adapter_b.name, at=at, revision=1, requests=50, kind=UsageKind.SAMPLING)


def test_the_usage_page_shows_sampling_apart(traffic, tenant_a):
    client = page_client(tenant_a.users["viewer"])
    inference = chart_data(client.get("/usage/"))
    sampling_page = client.get("/usage/?kind=sampling")
    sampling = chart_data(sampling_page)

    assert (inference["kind"], inference["totals"]["requests"], inference["totals"]["total_tokens"]) == (
        "inference",
        2,
        30,
    )
    assert (sampling["kind"], sampling["totals"]["requests"], sampling["totals"]["total_tokens"]) == (
        "sampling",
        4,
        3 * 71,
    )
    assert sampling["totals"]["unavailable"] == 1
    html = sampling_page.content.decode()
    assert 'data-usage-line="support-bot@r5"' in html and 'data-usage-line="support-bot@r2"' not in html
    assert "training pipelines&#x27; samples" in html or "training pipelines' samples" in html
    assert '<option value="sampling" selected>' in html
    # The live section and the CSV read the same kind.
    assert chart_data(client.get("/usage/?kind=sampling&fragment=charts"))["totals"]["requests"] == 4
    rows = csv_rows(client.get("/usage/export.csv?kind=sampling"))
    assert [(r["revision"], r["requests"]) for r in rows] == [("r5", "4")]
    assert client.get("/usage/?kind=warmup").status_code == 404  # not a choice of the switch


def test_the_usage_api_reports_sampling_as_its_own_kind(traffic, tenant_a):
    client = tenant_a.client_as("key:pipeline")
    sampled = client.get("/api/v1/usage/?kind=sampling&group_by=revision").json()
    assert [(r["revision"], r["requests"]) for r in sampled["rows"]] == [("r5", 4)]
    inference = client.get("/api/v1/usage/?group_by=revision").json()
    assert [(r["revision"], r["requests"]) for r in inference["rows"]] == [("r2", 2)]
    everything = client.get("/api/v1/usage/?kind=all&group_by=revision").json()
    assert everything["totals"]["requests"] == 6
