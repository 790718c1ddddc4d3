"""The usage API (`GET /api/v1/usage/`): sums and latency percentiles per group from metered rows, one period per
answer chosen from the range and the retention, bounded input and cost, CSV, and who may read whose usage."""

from __future__ import annotations

import bisect
import csv
import io
from datetime import UTC, datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from serving import services
from serving.models import LATENCY_BOUNDS_MS, USAGE_COUNTS, UsageKind, UsagePeriod, UsageRecord
from serving.selectors import usage as usage_selectors
from serving.services.usage import minute_of, usage_purge
from tenants.models import ApiKey, Tenant
from tests.conftest import error_of
from tests.factories import UserFactory
from tests.serving.gateway_world import complete

pytestmark = pytest.mark.django_db

URL = "/api/v1/usage/"
SUPPORT, SUMMARIZER = (11, "support-bot"), (12, "summarizer")


def meter(
    tenant: Tenant,
    at: datetime,
    latencies: list[float],
    *,
    prompt: int = 0,
    completion: int = 0,
    key_id: int = 0,
    adapter: tuple[int, str] = SUPPORT,
    revision: int = 1,
    node: str = "node-a",
    status: int = 200,
    kind: str = UsageKind.INFERENCE,
) -> None:
    """Requests as the gateway meters them (one latency each; `prompt`/`completion` their tokens together),
    added to their minute, hour and day rows by the metering service itself."""
    values = [0.0] * len(USAGE_COUNTS)
    values[0], values[1], values[2], values[3] = len(latencies), prompt, completion, sum(latencies)
    for ms in latencies:
        values[USAGE_COUNTS.index("lat_0") + bisect.bisect_left(LATENCY_BOUNDS_MS, ms)] += 1
    key = (minute_of(at), kind, tenant.id, key_id, adapter[0], adapter[1], revision, node, status)
    services.usage_add(counts={key: values})


@pytest.fixture
def traffic(tenant_a, tenant_b):
    """Half an hour ago: tenant A's calls to support-bot r1 and r2 and to summarizer (by a key since deleted),
    a warm-up of support-bot; tenant B's calls to globex-bot."""
    at = timezone.now() - timedelta(minutes=30)
    pipeline, _ = tenant_a.key("pipeline")
    gone, _ = tenant_a.key("deploy", "inference")  # deleted below; no other test uses this one
    gone_id = gone.id
    gone.delete()
    a = tenant_a.tenant
    meter(a, at, [30] * 20, prompt=200, completion=100, key_id=pipeline.id)
    meter(a, at, [300] * 4, prompt=40, completion=80, key_id=pipeline.id, revision=2, node="node-b")
    meter(a, at, [5], key_id=pipeline.id, revision=2, node="node-b", status=503)
    meter(a, at, [40_000], prompt=10, completion=5, key_id=gone_id, adapter=SUMMARIZER)
    meter(a, at, [20], prompt=3, completion=2, kind=UsageKind.WARMUP)
    b_key, _ = tenant_b.key("pipeline")
    meter(tenant_b.tenant, at, [10] * 7, prompt=70, completion=70, key_id=b_key.id, adapter=(21, "globex-bot"))
    return {"pipeline": pipeline, "gone_id": gone_id, "b_key": b_key}


def z(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def get(client, **params):
    return client.get(URL, params)


def counts(row: dict) -> tuple:
    return tuple(row[k] for k in ("requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens"))


def groups(body: dict) -> list[dict]:
    return [{c: row[c] for c in body["columns"]} for row in body["rows"]]


# ---------------------------------------------------------------- sums and percentiles


def test_a_tenants_usage_per_adapter_with_sums_and_percentiles_from_the_histogram(tenant_a, traffic):
    answer = get(tenant_a.client_as("viewer"))

    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["tenant"], body["period"], body["kind"], body["truncated"]) == ("acme", "minute", "inference", False)
    assert body["group_by"] == body["columns"] == ["adapter"]
    summarizer, support = body["rows"]
    assert (summarizer["adapter"], support["adapter"]) == ("summarizer", "support-bot")
    assert counts(support) == (25, 1, 240, 180, 420)
    # Buckets: 1 request ≤ 10 ms, 20 in (25, 50], 4 in (250, 500]; interpolated inside the bucket of the rank.
    assert support["latency_p50_ms"] == pytest.approx(25 + 25 * (12.5 - 1) / 20, abs=0.01)
    assert support["latency_p95_ms"] == pytest.approx(250 + 250 * (23.75 - 21) / 4, abs=0.01)
    assert support["latency_mean_ms"] == pytest.approx((5 + 20 * 30 + 4 * 300) / 25, abs=0.01)
    # Slower than the last bound: reported as that bound (a lower bound); the mean has the truth.
    assert counts(summarizer) == (1, 0, 10, 5, 15)
    assert summarizer["latency_p50_ms"] == summarizer["latency_p95_ms"] == LATENCY_BOUNDS_MS[-1]
    assert summarizer["latency_mean_ms"] == 40_000
    totals = body["totals"]
    assert counts(totals) == (26, 1, 250, 185, 435)
    assert totals["latency_p50_ms"] == pytest.approx(25 + 25 * (13 - 1) / 20, abs=0.01)
    assert totals["latency_p95_ms"] == pytest.approx(250 + 250 * (24.7 - 21) / 4, abs=0.01)


def test_percentiles_at_a_bucket_bound_are_the_bound_and_none_without_requests():
    histogram = [0] * (len(LATENCY_BOUNDS_MS) + 1)
    histogram[1] = 10  # (10, 25]
    assert usage_selectors.histogram_quantile(1.0, tuple(histogram)) == 25
    assert usage_selectors.histogram_quantile(0.5, tuple(histogram)) == pytest.approx(17.5)
    assert usage_selectors.histogram_quantile(0.5, (0,) * len(histogram)) is None


def test_warm_ups_are_left_out_unless_asked_for(tenant_a, traffic):
    client = tenant_a.client_as("owner")

    warmup = get(client, kind="warmup").json()
    both = get(client, kind="all").json()

    assert [(r["adapter"], counts(r)) for r in warmup["rows"]] == [("support-bot", (1, 0, 3, 2, 5))]
    assert warmup["kind"] == "warmup"
    assert counts(both["totals"]) == (27, 1, 253, 187, 440)
    assert get(client, kind="billed").status_code == 400


@pytest.mark.parametrize(
    ("group_by", "expected"),
    [
        ("revision", [("summarizer", "r1", 1), ("support-bot", "r1", 20), ("support-bot", "r2", 5)]),
        ("node", [("node-a", 21), ("node-b", 5)]),
        ("status", [(200, 25), (503, 1)]),
        ("adapter,status", [("summarizer", 200, 1), ("support-bot", 200, 24), ("support-bot", 503, 1)]),
    ],
)
def test_each_dimension_groups_the_rows(tenant_a, traffic, group_by, expected):
    body = get(tenant_a.client_as("owner"), group_by=group_by).json()

    assert [(*row.values(), r["requests"]) for row, r in zip(groups(body), body["rows"], strict=True)] == expected
    assert counts(body["totals"]) == (26, 1, 250, 185, 435)  # whatever the grouping


def test_keys_are_named_by_prefix_and_a_deleted_one_by_its_id(tenant_a, traffic):
    body = get(tenant_a.client_as("owner"), group_by="key").json()

    assert body["columns"] == ["key", "key_id"]
    assert [(g["key"], g["key_id"], r["requests"]) for g, r in zip(groups(body), body["rows"], strict=True)] == [
        (traffic["pipeline"].prefix, traffic["pipeline"].id, 25),
        (None, traffic["gone_id"], 1),
    ]


def test_days_and_hours_group_the_rows_of_a_longer_range(tenant_a):
    base = (timezone.now() - timedelta(days=10)).replace(hour=0, minute=0, second=0, microsecond=0)
    a = tenant_a.tenant
    meter(a, base + timedelta(hours=1), [30], prompt=1)
    meter(a, base + timedelta(hours=1, minutes=30), [30] * 2, prompt=2, adapter=SUMMARIZER)
    meter(a, base + timedelta(days=1, hours=5), [30] * 4, prompt=4)
    client = tenant_a.client_as("owner")
    span = {"from": base.isoformat(), "to": (base + timedelta(days=3)).isoformat()}

    by_day = get(client, group_by="day", **span).json()
    by_hour = get(client, group_by="hour", **span).json()
    by_day_adapter = get(client, group_by="day,adapter", **span).json()

    day0, day1 = base.date().isoformat(), (base + timedelta(days=1)).date().isoformat()
    assert by_day["period"] == "hour"  # more than 2 days: hour rows
    assert [(g["day"], r["requests"]) for g, r in zip(groups(by_day), by_day["rows"], strict=True)] == [
        (day0, 3),
        (day1, 4),
    ]
    assert [g["hour"] for g in groups(by_hour)] == [
        z(base + timedelta(hours=1)),
        z(base + timedelta(days=1, hours=5)),
    ]
    assert [r["requests"] for r in by_hour["rows"]] == [3, 4]
    assert groups(by_day_adapter) == [
        {"day": day0, "adapter": "summarizer"},
        {"day": day0, "adapter": "support-bot"},
        {"day": day1, "adapter": "support-bot"},
    ]
    assert (by_day["from"], by_day["to"]) == (z(base), z(base + timedelta(days=3)))


@pytest.mark.django_db(transaction=True)
def test_an_end_to_end_request_through_the_gateway_is_in_the_answer(world):
    _, token = world.tenant_a.key("inference")
    assert complete(world, token).status == 200
    assert complete(world, token).status == 200
    world.state.meter.flush()

    body = get(world.tenant_a.client_as("viewer"), group_by="revision").json()

    assert [(g["adapter"], g["revision"]) for g in groups(body)] == [("support-bot", "r1")]
    assert counts(body["rows"][0]) == (2, 0, 6, 4, 10)
    assert body["rows"][0]["latency_p50_ms"] is not None


# ---------------------------------------------------------------- one period per answer


NOW = datetime(2026, 6, 15, 12, 0, tzinfo=UTC)
DAY, MINUTE = timedelta(days=1), timedelta(minutes=1)


@pytest.mark.parametrize(
    ("start", "end", "period"),
    [
        (NOW - 2 * DAY, NOW, "minute"),  # 2 days: minute rows
        (NOW - 2 * DAY - MINUTE, NOW, "hour"),  # longer
        (NOW - 7 * DAY, NOW - 6 * DAY, "minute"),  # starts as old as minute rows are kept
        (NOW - 7 * DAY - MINUTE, NOW - 6 * DAY, "hour"),  # older: purged minute rows would be missing
        (NOW - 93 * DAY, NOW - 92 * DAY, "hour"),
        (NOW - 93 * DAY - MINUTE, NOW - 92 * DAY, "day"),
        (NOW - 400 * DAY, NOW, "day"),
    ],
)
def test_the_period_follows_the_range_and_the_retention_edges(settings, start, end, period):
    settings.MINT_USAGE_MINUTE_RETENTION_DAYS, settings.MINT_USAGE_HOUR_RETENTION_DAYS = 7, 93

    assert usage_selectors.usage_period(start=start, end=end, now=NOW) == period


def test_a_shorter_minute_retention_moves_the_edge(settings):
    settings.MINT_USAGE_MINUTE_RETENTION_DAYS = 1

    assert usage_selectors.usage_period(start=NOW - DAY, end=NOW, now=NOW) == "minute"
    assert usage_selectors.usage_period(start=NOW - DAY - MINUTE, end=NOW, now=NOW) == "hour"


def test_every_period_counts_each_request_once(tenant_a, traffic):
    client = tenant_a.client_as("owner")
    now = timezone.now()

    answers = {
        days: get(client, **{"from": (now - timedelta(days=days)).isoformat(), "to": now.isoformat()}).json()
        for days in (1, 5, 200)
    }

    assert [answers[d]["period"] for d in (1, 5, 200)] == ["minute", "hour", "day"]
    assert {counts(a["totals"]) for a in answers.values()} == {(26, 1, 250, 185, 435)}


def test_past_the_minute_retention_hour_rows_answer_after_the_purge(tenant_a, settings):
    settings.MINT_USAGE_MINUTE_RETENTION_DAYS = 7
    now = timezone.now()
    meter(tenant_a.tenant, now - timedelta(days=8), [30] * 3, prompt=9)
    assert usage_purge()["minute"] == 1
    span = {"from": (now - timedelta(days=8, hours=2)).isoformat(), "to": (now - timedelta(days=7)).isoformat()}

    body = get(tenant_a.client_as("owner"), **span).json()

    assert body["period"] == "hour"
    assert counts(body["totals"]) == (3, 0, 9, 0, 9)


def test_the_answer_covers_the_bounds_rounded_up_to_its_period(tenant_a):
    base = (timezone.now() - timedelta(days=10)).replace(hour=0, minute=0, second=0, microsecond=0)
    meter(tenant_a.tenant, base + timedelta(hours=1, minutes=10), [30])  # in the hour 01:00, before `from`
    meter(tenant_a.tenant, base + timedelta(hours=2, minutes=10), [30] * 2)
    span = {"from": (base + timedelta(hours=1, minutes=30)).isoformat(), "to": (base + timedelta(days=3)).isoformat()}

    body = get(tenant_a.client_as("owner"), **span).json()

    assert body["from"] == z(base + timedelta(hours=2))
    assert body["totals"]["requests"] == 2


def test_hour_groups_are_refused_where_only_day_rows_cover_the_range(tenant_a):
    now = timezone.now()
    span = {"from": (now - timedelta(days=120)).isoformat(), "to": (now - timedelta(days=100)).isoformat()}

    answer = get(tenant_a.client_as("owner"), group_by="hour", **span)

    assert answer.status_code == 400
    error = error_of(answer)
    assert error["code"] == "group_by_unavailable"
    assert "group_by" in error["detail"] and "93" in error["message"]


def test_minutes_group_minute_rows_and_are_refused_over_hour_rows(tenant_a):
    at = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    meter(tenant_a.tenant, at, [30] * 2, prompt=4)
    meter(tenant_a.tenant, at + timedelta(minutes=1), [30], prompt=2)
    owner = tenant_a.client_as("owner")

    body = get(owner, group_by="minute", **{"from": z(at - timedelta(minutes=5))}).json()
    assert [(row["minute"], row["requests"], row["prompt_tokens"]) for row in body["rows"]] == [
        (z(at), 2, 4),
        (z(at + timedelta(minutes=1)), 1, 2),
    ]

    refused = get(owner, group_by="minute", **{"from": z(at - timedelta(days=5))})
    assert refused.status_code == 400 and error_of(refused)["code"] == "group_by_unavailable"


def test_one_adapter_only(tenant_a, traffic):
    body = get(tenant_a.client_as("viewer"), adapter="summarizer", group_by="status").json()

    assert [(row["status"], row["requests"]) for row in body["rows"]] == [(200, 1)]
    assert body["totals"]["requests"] == 1
    assert get(tenant_a.client_as("viewer"), adapter="Not A Name").status_code == 400


# ---------------------------------------------------------------- bounded input


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"from": "yesterday"}, "from"),
        ({"to": "2026-02-30"}, "to"),
        ({"from": "2026-01-02", "to": "2026-01-02"}, "to"),
        ({"from": "2026-01-03T00:00:00Z", "to": "2026-01-02"}, "to"),
        ({"group_by": "model"}, "group_by"),
        ({"group_by": "adapter,node,status"}, "group_by"),
        ({"group_by": "day,hour"}, "group_by"),
        ({"group_by": "hour,minute"}, "group_by"),
        ({"group_by": "node,node"}, "group_by"),
        ({"kind": "billed"}, "kind"),
    ],
)
def test_bad_input_is_refused_naming_the_field(tenant_a, params, field):
    answer = get(tenant_a.client_as("owner"), **params)

    assert answer.status_code == 400
    error = error_of(answer)
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(f"{field}:"), error
    assert field in error["detail"]


def test_a_range_over_the_limit_is_refused_naming_it(tenant_a):
    answer = get(tenant_a.client_as("owner"), **{"from": "2025-01-01", "to": "2026-02-06"})

    assert answer.status_code == 400
    error = error_of(answer)
    assert error["code"] == "range_too_long"
    assert error["detail"] == {"max_days": 400} and "400 days" in error["message"]
    assert get(tenant_a.client_as("owner"), **{"from": "2025-01-01", "to": "2026-02-05"}).status_code == 200


def test_dates_and_offsets_are_read_as_utc(tenant_a):
    start = (timezone.now() - timedelta(hours=3)).replace(second=0, microsecond=0)
    end = start + timedelta(hours=1)
    plus_one = dt_timezone(timedelta(hours=1))
    params = {"from": start.astimezone(plus_one).isoformat(), "to": end.replace(tzinfo=None).isoformat()}

    body = get(tenant_a.client_as("owner"), **params).json()

    assert (body["period"], body["from"], body["to"]) == ("minute", z(start), z(end))
    day = get(tenant_a.client_as("owner"), **{"from": "2025-01-01", "to": "2025-01-31"}).json()
    assert (day["period"], day["from"], day["to"]) == ("day", "2025-01-01T00:00:00Z", "2025-01-31T00:00:00Z")


# ---------------------------------------------------------------- bounded cost


def test_one_aggregate_query_whatever_the_rows(tenant_a, traffic, django_assert_num_queries):
    for minute in range(1, 40):
        meter(tenant_a.tenant, timezone.now() - timedelta(minutes=minute), [30], node=f"n{minute % 7}")

    with django_assert_num_queries(1):
        report = usage_selectors.usage_report(tenant=tenant_a.tenant, group_by=("adapter", "node"))
    assert len(report.rows) == 10  # support-bot on node-a, node-b, n0 … n6; summarizer on node-a
    with django_assert_num_queries(2):  # and the keys' prefixes
        usage_selectors.usage_report(tenant=tenant_a.tenant, group_by=("key",))


def test_the_api_costs_a_fixed_number_of_queries(tenant_a, traffic):
    client = tenant_a.client_as("owner")
    get(client)  # the session's first read
    with CaptureQueriesContext(connection) as few:
        assert get(client, group_by="adapter").status_code == 200
    for minute in range(1, 30):
        meter(tenant_a.tenant, timezone.now() - timedelta(minutes=minute), [30], adapter=(100 + minute, f"a{minute}"))
    with CaptureQueriesContext(connection) as many:
        body = get(client, group_by="adapter").json()

    assert len(body["rows"]) == 31
    assert len(many.captured_queries) == len(few.captured_queries) == 4  # session, user, membership, usage
    key_client = tenant_a.client_as("key:pipeline")
    get(key_client)  # the key's first use writes last_used_at
    with CaptureQueriesContext(connection) as by_key:
        assert get(key_client, group_by="key").status_code == 200
    assert len(by_key.captured_queries) == 3  # the key, usage, the keys' prefixes


def test_groups_past_the_cap_are_left_off_and_flagged_with_the_totals_kept(tenant_a, traffic):
    with CaptureQueriesContext(connection) as queries:
        report = usage_selectors.usage_report(tenant=tenant_a.tenant, group_by=("status",), max_groups=1)

    assert report.truncated is True
    assert [(r.group, r.counts.requests) for r in report.rows] == [({"status": 200}, 25)]
    assert report.totals.requests == 26  # the whole range, from one more query
    assert len(queries.captured_queries) == 2
    assert usage_selectors.usage_report(tenant=tenant_a.tenant, group_by=("status",)).truncated is False


# ---------------------------------------------------------------- CSV


def test_csv_has_a_header_and_a_line_per_group(tenant_a, traffic):
    client = tenant_a.client_as("owner")

    answer = client.get(URL, {"group_by": "revision"}, HTTP_ACCEPT="text/csv")
    by_format = client.get(URL, {"group_by": "revision", "format": "csv"})

    assert answer.status_code == 200
    assert answer["Content-Type"] == "text/csv; charset=utf-8"
    assert answer["Content-Disposition"].startswith('attachment; filename="usage-acme-')
    assert answer["X-Mint-Usage-Period"] == "minute"
    lines = list(csv.reader(io.StringIO(answer.content.decode())))
    assert lines[0] == [
        "adapter",
        "revision",
        "requests",
        "errors",
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "latency_p50_ms",
        "latency_p95_ms",
        "latency_mean_ms",
        "cold_starts",
    ]
    assert [line[:7] for line in lines[1:]] == [
        ["summarizer", "r1", "1", "0", "10", "5", "15"],
        ["support-bot", "r1", "20", "0", "200", "100", "300"],
        ["support-bot", "r2", "5", "1", "40", "80", "120"],
    ]
    assert by_format.content == answer.content


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted(tenant_a):
    meter(tenant_a.tenant, timezone.now() - timedelta(minutes=5), [30], adapter=(9, '=HYPERLINK("http://x")'))

    answer = tenant_a.client_as("owner").get(URL, {"format": "csv"})

    (line,) = list(csv.reader(io.StringIO(answer.content.decode())))[1:]
    assert line[0] == '\'=HYPERLINK("http://x")'


def test_csv_errors_keep_the_json_error_shape(tenant_a):
    answer = tenant_a.client_as("owner").get(URL, {"format": "csv", "group_by": "model"})

    assert answer.status_code == 400 and answer["Content-Type"] == "application/json"
    assert error_of(answer)["message"].startswith("group_by:")


# ---------------------------------------------------------------- who reads whose usage


@pytest.mark.parametrize("principal", ["viewer", "developer", "approver", "owner", "key:pipeline", "key:deploy"])
def test_members_and_pipeline_or_deploy_keys_read_their_tenants_usage(tenant_a, traffic, principal):
    body = get(tenant_a.client_as(principal)).json()

    assert body["totals"]["requests"] == 26


def test_an_inference_key_reads_no_usage(tenant_a, traffic):
    answer = get(tenant_a.client_as("key:inference"))

    assert answer.status_code == 403
    assert error_of(answer)["code"] == "insufficient_scope"


def test_another_tenant_sees_none_of_its_usage(tenant_a, tenant_b, traffic):
    for principal in ("owner", "viewer", "key:pipeline"):
        body = get(tenant_b.client_as(principal), group_by="adapter,node").json()
        assert body["tenant"] == "globex"
        assert groups(body) == [{"adapter": "globex-bot", "node": "node-a"}], principal
        assert body["totals"]["requests"] == 7
    keys = get(tenant_b.client_as("owner"), group_by="key").json()
    assert [g["key"] for g in groups(keys)] == [traffic["b_key"].prefix]


def test_naming_another_tenant_is_not_found_like_a_missing_one(tenant_a, tenant_b, traffic):
    client = tenant_b.client_as("owner")

    other, missing = get(client, tenant="acme"), get(client, tenant="no-such-tenant")

    assert other.status_code == missing.status_code == 404
    assert error_of(other)["code"] == error_of(missing)["code"] == "tenant_not_found"
    assert get(client, tenant="globex").json()["totals"]["requests"] == 7


def test_outsiders_and_strangers_read_nothing(tenant_a, traffic):
    from rest_framework.test import APIClient

    outsider = get(tenant_a.client_as("outsider"))
    anonymous = get(APIClient())

    assert (outsider.status_code, error_of(outsider)["code"]) == (403, "no_tenant")
    assert anonymous.status_code == 401


def test_staff_see_every_tenant_each_row_naming_its_own(tenant_a, tenant_b, traffic):
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_login(UserFactory(username="platform-ops", is_staff=True))

    everyone = get(client).json()
    one = get(client, tenant="globex", group_by="key").json()

    assert everyone["tenant"] is None and everyone["columns"] == ["tenant", "adapter"]
    assert groups(everyone) == [
        {"tenant": "acme", "adapter": "summarizer"},
        {"tenant": "acme", "adapter": "support-bot"},
        {"tenant": "globex", "adapter": "globex-bot"},
    ]
    assert everyone["totals"]["requests"] == 33
    assert one["tenant"] == "globex"
    assert groups(one) == [{"tenant": "globex", "key": traffic["b_key"].prefix, "key_id": traffic["b_key"].id}]
    missing = get(client, tenant="no-such-tenant")
    assert (missing.status_code, error_of(missing)["code"]) == (404, "tenant_not_found")


def test_a_staff_members_key_reads_only_its_own_tenant(tenant_a, tenant_b, traffic):
    owner = tenant_a.users["owner"]
    owner.is_staff = True
    owner.save(update_fields=["is_staff"])

    body = get(tenant_a.client_as("key:pipeline")).json()

    assert body["tenant"] == "acme" and "tenant" not in body["columns"]
    assert body["totals"]["requests"] == 26


def test_usage_of_keys_is_looked_up_within_the_tenant(tenant_a, tenant_b):
    b_key, _ = tenant_b.key("pipeline")
    # A row of tenant A naming tenant B's key (which the gateway never writes) shows no prefix of B's.
    meter(tenant_a.tenant, timezone.now() - timedelta(minutes=5), [30], key_id=b_key.id)

    body = get(tenant_a.client_as("owner"), group_by="key").json()

    assert groups(body) == [{"key": None, "key_id": b_key.id}]
    assert ApiKey.objects.filter(id=b_key.id).exists()


def test_rows_of_all_periods_exist_for_metered_traffic(tenant_a, traffic):
    """The fixture's traffic is in minute, hour and day rows alike (the metering service writes all three)."""
    assert set(UsageRecord.objects.values_list("period", flat=True)) == set(UsagePeriod.values)
