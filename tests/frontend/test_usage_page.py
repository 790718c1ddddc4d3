"""The usage page (`/usage/`), its live section and CSV download, and the adapter's usage panel.

Usage rows are written as the gateway's flush writes them (`serving.services.usage_add`), with known counts, and
the page must show exactly those of the viewer's tenant: in the charts' data, in the table, in the CSV.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from frontend.selectors import usage as usage_selectors
from serving import services as serving_services
from serving.models import LATENCY_BOUNDS_MS, LATENCY_BUCKETS, UsageKind
from tests.frontend.conftest import page_client

pytestmark = pytest.mark.django_db


def meter(
    tenant,
    adapter_name: str,
    *,
    at: datetime,
    revision: int = 2,
    status: int = 200,
    requests: int = 1,
    prompt: int = 10,
    completion: int = 5,
    latency_ms: float = 30.0,
    kind: str = UsageKind.INFERENCE,
    adapter_id: int = 1,
) -> None:
    """`requests` requests of `adapter_name`@r`revision` in the minute of `at`, all with `latency_ms`."""
    histogram = [0] * len(LATENCY_BUCKETS)
    histogram[bisect.bisect_left(LATENCY_BOUNDS_MS, latency_ms)] = requests
    minute = at.astimezone(UTC).replace(second=0, microsecond=0)
    key = (minute, kind, tenant.id, 0, adapter_id, adapter_name, revision, "node-1", status)
    values = [requests, prompt * requests, completion * requests, latency_ms * requests, *histogram, 0]  # cold starts
    serving_services.usage_add(counts={key: values})


def chart_data(response) -> dict:
    """The charts' data as the page embeds it (json_script `usage-data`)."""
    html = response.content.decode()
    start = html.index('<script id="usage-data" type="application/json">') + len(
        '<script id="usage-data" type="application/json">'
    )
    return json.loads(html[start : html.index("</script>", start)])


def csv_rows(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


@pytest.fixture
def usage(tenant_a, tenant_b, adapter_a, adapter_b):
    """Tenant A: support-bot r2 (3 x 200, 120/60 tokens), r1 (1 x 503), one 429 before any adapter was named,
    and a warm-up (never billed); all 10 minutes ago. Tenant B: globex-secret-bot r1, 7 x 200."""
    now = timezone.now()
    at = now - timedelta(minutes=10)
    a = tenant_a.tenant
    meter(a, adapter_a.name, at=at, requests=3, prompt=40, completion=20, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=at, revision=1, status=503, prompt=0, completion=0, adapter_id=adapter_a.id)
    meter(a, "", at=at, revision=0, status=429, prompt=0, completion=0, adapter_id=0)
    meter(a, adapter_a.name, at=at, kind=UsageKind.WARMUP, requests=9, adapter_id=adapter_a.id)
    meter(tenant_b.tenant, adapter_b.name, at=at, revision=1, requests=7, prompt=1000, adapter_id=adapter_b.id)
    return now


def test_the_page_shows_the_tenants_totals_by_adapter_and_revision(usage, tenant_a):
    response = page_client(tenant_a.users["viewer"]).get("/usage/")
    assert response.status_code == 200
    data = chart_data(response)
    assert data["range"] == "day" and data["period"] == "minute"
    assert data["totals"] == {
        "requests": 5,
        "errors": 2,
        "prompt_tokens": 120,
        "completion_tokens": 60,
        "total_tokens": 180,
        "latency_p50_ms": data["totals"]["latency_p50_ms"],
        "latency_p95_ms": data["totals"]["latency_p95_ms"],
        "latency_mean_ms": 30.0,
        "cold_starts": 0,
        "unavailable": 1,
        "limited": 1,
    }
    assert 25 <= data["totals"]["latency_p50_ms"] <= 50  # inside the 25-50 ms bucket
    # The series covers the same rows as the table: its buckets add up to the totals.
    assert sum(data["requests"]) == 5 and sum(data["prompt_tokens"]) == 120
    assert sum(data["unavailable"]) == 1 and sum(data["limited"]) == 1 and sum(data["errors"]) == 2
    assert len(data["x"]) in (24, 25) and data["x"] == sorted(data["x"])
    html = response.content.decode()
    assert 'data-usage-line="support-bot@r2"' in html and 'data-usage-line="support-bot@r1"' in html
    assert "(no adapter)" in html
    assert 'data-total="requests">5<' in html
    assert "globex" not in html.lower()


def test_tenant_bs_member_sees_none_of_as_usage(usage, tenant_b, adapter_a):
    client = page_client(tenant_b.users["owner"])
    response = client.get("/usage/")
    data = chart_data(response)
    assert data["totals"]["requests"] == 7 and data["totals"]["prompt_tokens"] == 7000
    html = response.content.decode()
    assert "support-bot" not in html and "acme" not in html.lower()
    csv_text = client.get("/usage/export.csv").content.decode()
    assert "support-bot" not in csv_text and "globex-secret-bot" in csv_text
    # A's adapter, named in B's dashboard, is not found (as an adapter that does not exist is).
    for url in (
        "/usage/?adapter=support-bot",
        "/usage/?adapter=support-bot&fragment=charts",
        "/usage/export.csv?adapter=support-bot",
        "/adapters/support-bot/?fragment=usage",
    ):
        refused = client.get(url)
        assert refused.status_code == 404, url
        body = refused.content.decode()
        assert "No such adapter." in body and "usage-data" not in body and "data-usage-line" not in body, url


def test_outsiders_and_strangers_are_refused_as_on_other_pages(usage, tenant_a):
    for url in ("/usage/", "/usage/?fragment=charts", "/usage/export.csv", "/adapters/support-bot/?fragment=usage"):
        anonymous = page_client().get(url)
        assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/"), url
        outsider = page_client(tenant_a.outsider).get(url)
        assert outsider.status_code == 404, url
        assert "not a member of any tenant" in outsider.content.decode()
        assert "support-bot@r2" not in outsider.content.decode()


def test_the_range_switch_reads_the_last_hour_day_or_30_days(tenant_a, adapter_a):
    now = timezone.now()
    a = tenant_a.tenant
    meter(a, adapter_a.name, at=now - timedelta(minutes=20), requests=1, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=now - timedelta(hours=5), requests=10, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=now - timedelta(days=10), requests=100, adapter_id=adapter_a.id)
    meter(a, adapter_a.name, at=now - timedelta(days=40), requests=1000, adapter_id=adapter_a.id)
    client = page_client(tenant_a.users["owner"])
    expected = {"hour": (1, "minute", 12, 300), "day": (11, "minute", None, 3600), "month": (111, "hour", None, 86400)}
    for name, (requests, period, points, bucket_s) in expected.items():
        data = chart_data(client.get(f"/usage/?range={name}"))
        assert (data["range"], data["totals"]["requests"], data["period"]) == (name, requests, period), name
        assert sum(data["requests"]) == requests, name
        assert data["bucket_s"] == bucket_s
        assert all(b - a == bucket_s for a, b in zip(data["x"], data["x"][1:], strict=False)), name
        if points is not None:
            assert len(data["x"]) == points
        # The live section re-reads the same range (`?fragment=charts` keeps the page's query).
        fragment = client.get(f"/usage/?range={name}&fragment=charts")
        assert fragment.status_code == 200 and "<h1" not in fragment.content.decode()
        assert chart_data(fragment)["totals"]["requests"] == requests
    assert len(chart_data(client.get("/usage/?range=month"))["x"]) in (30, 31)
    assert client.get("/usage/?range=year").status_code == 404
    html = client.get("/usage/?range=hour").content.decode()
    assert '<option value="hour" selected>' in html


def test_one_adapter_is_charted_alone(usage, tenant_a, adapter_a, dense_base):
    from adapters.models import Adapter

    other = Adapter.objects.create(tenant=tenant_a.tenant, name="other-bot", base_model=dense_base)
    meter(tenant_a.tenant, other.name, at=usage - timedelta(minutes=3), requests=4, adapter_id=other.id)
    client = page_client(tenant_a.users["owner"])
    assert chart_data(client.get("/usage/"))["totals"]["requests"] == 9
    data = chart_data(client.get("/usage/?adapter=other-bot&range=hour"))
    assert data["adapter"] == "other-bot"
    assert data["totals"]["requests"] == 4 and sum(data["requests"]) == 4
    assert sum(data["unavailable"]) == 0 and sum(data["limited"]) == 0  # its own 503 and 429 per bucket
    html = client.get("/usage/?adapter=support-bot").content.decode()
    assert 'data-usage-line="support-bot@r2"' in html and "other-bot@" not in html
    support = chart_data(client.get("/usage/?adapter=support-bot"))
    assert support["totals"]["unavailable"] == 1 and sum(support["unavailable"]) == 1  # per bucket too


def test_the_csv_download_holds_the_table_of_the_same_range(usage, tenant_a):
    # A name a spreadsheet would run as a formula (usage rows keep the name the gateway saw).
    meter(tenant_a.tenant, "=HYPERLINK(1)", at=usage - timedelta(minutes=2), revision=4, adapter_id=99)
    client = page_client(tenant_a.users["viewer"])
    response = client.get("/usage/export.csv?range=day")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="usage-acme-')
    assert response["X-Mint-Usage-Period"] == "minute"
    assert response["Cache-Control"] == "no-store"
    rows = csv_rows(response)
    assert list(rows[0]) == list(
        ("adapter", "revision", *usage_selectors.serving_usage.COUNT_COLUMNS, "status_503", "status_429")
    )
    by_line = {(r["adapter"], r["revision"]): r for r in rows}
    assert by_line[("support-bot", "r2")]["requests"] == "3"
    assert by_line[("support-bot", "r2")]["prompt_tokens"] == "120"
    assert by_line[("support-bot", "r1")]["status_503"] == "1"
    assert by_line[("", "")]["status_429"] == "1"
    assert ("'=HYPERLINK(1)", "r4") in by_line
    assert sum(int(r["requests"]) for r in rows) == 6  # no totals line: the column sums to the total
    # Another range, another file: the hour holds the same rows (10 minutes ago), 30 days too; nothing older.
    assert sum(int(r["requests"]) for r in csv_rows(client.get("/usage/export.csv?range=hour"))) == 6
    assert len(csv_rows(client.get("/usage/export.csv?range=day&adapter=support-bot"))) == 2


def test_the_adapter_page_has_a_usage_panel_per_revision(usage, tenant_a, adapter_a):
    client = page_client(tenant_a.users["viewer"])
    page = client.get("/adapters/support-bot/").content.decode()
    assert 'data-fragment="usage"' in page and "data-load" in page
    assert "frontend/vendor/uplot/uPlot.iife.min.js" in page and "frontend/usage.js" in page
    panel = client.get("/adapters/support-bot/?fragment=usage")
    assert panel.status_code == 200
    html = panel.content.decode()
    assert "<h1" not in html
    start = html.index('type="application/json">') + len('type="application/json">')
    data = json.loads(html[start : html.index("</script>", start)])
    assert data["adapter"] == "support-bot" and data["range"] == "day"
    assert data["totals"]["requests"] == 4 and sum(data["requests"]) == 4 and sum(data["total_tokens"]) == 180
    assert 'data-usage-line="r2"' in html and 'data-usage-line="r1"' in html
    assert "(none)" not in html  # the 429 named no adapter: it is not this adapter's
    assert "globex" not in html.lower()


def test_the_nodes_page_shows_mean_load_and_warm_times(catalog_a, tenant_a):
    html = page_client(tenant_a.users["viewer"]).get("/nodes/").content.decode()
    assert "<td data-load-times>120 ms / 40 ms</td>" in html


def test_members_find_the_usage_page_in_the_navigation(tenant_a, adapter_a):
    html = page_client(tenant_a.users["viewer"]).get("/").content.decode()
    assert '<a href="/usage/">Usage</a>' in html
    current = page_client(tenant_a.users["viewer"]).get("/usage/").content.decode()
    assert '<a href="/usage/" aria-current="page">Usage</a>' in current


# session, user, memberships: every signed-in page; then the tenant's adapter names (the switch) and the reads.
USAGE_QUERIES = {
    "/usage/": 3 + 1 + 1 + 1,  # series by (hour, status), table by (revision, status)
    "/usage/?range=month": 3 + 1 + 1 + 1,  # series by (day, status)
    "/usage/?range=day&adapter=support-bot": 3 + 1 + 1 + 1,  # series of its rows by (hour, status)
    "/usage/?range=hour": 3 + 1 + 1 + 1,  # series by (minute, status), in 5-minute buckets
    "/usage/?fragment=charts": 3 + 1 + 1 + 1,
    "/usage/export.csv": 3 + 1 + 1,  # the table only
    "/adapters/support-bot/?fragment=usage": 3 + 2 + 1 + 1,  # adapter and aliases, series, table
}


@pytest.mark.parametrize("url", list(USAGE_QUERIES))
def test_usage_query_count_is_pinned(usage, tenant_a, adapter_a, django_assert_num_queries, url):
    for minutes in range(0, 600, 7):  # many rows in many buckets: the count does not grow with them
        for revision in (1, 2, 3):
            meter(tenant_a.tenant, adapter_a.name, at=usage - timedelta(minutes=minutes), revision=revision)
    client = page_client(tenant_a.users["owner"])
    client.get("/")  # the first request stores the tenant in the session
    with django_assert_num_queries(USAGE_QUERIES[url]):
        assert client.get(url).status_code == 200
