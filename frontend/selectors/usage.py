"""Reads for the usage page and the adapter's usage panel: the tenant's metered usage over the last hour, day or
30 days, as a time series (for the charts) and per adapter and revision (the table and the CSV).

Every number comes from `serving.selectors.usage.usage_report`, which picks the rows' period (minute, hour or
day, `usage_period`) and sums them in SQL (one adapter's rows only, when one is chosen); here the report's
groups are only put in buckets: the series is one report by (time, status), so 503 and 429 per bucket come from
it, the last hour by minute summed into 5-minute buckets, the day by hour, 30 days by day; the table is one
report by (revision, status).

Queries: the series (1), the table (1), each one more when the report had more than `max_groups` groups (it
then sums the totals); the adapter's name is checked by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.utils import timezone

from adapters import selectors as adapter_selectors
from serving.selectors import usage as serving_usage
from serving.selectors.usage import UsageCounts, UsageReport
from tenants.models import Tenant

HOUR_SLICE = timedelta(minutes=5)
HOUR_SLICES = 12


@dataclass(frozen=True)
class UsageRange:
    """One choice of the range switch: how far back, and the time dimension of the report that buckets it."""

    name: str
    label: str  # "the last day", for headings and the charts' text alternative
    per: str  # a bucket in words: "hour"
    span: timedelta
    bucket: timedelta
    dimension: str  # the report's time dimension (its rows are summed into the range's buckets)


USAGE_RANGES = {
    "hour": UsageRange("hour", "the last hour", "5 minutes", timedelta(hours=1), HOUR_SLICE, "minute"),
    "day": UsageRange("day", "the last day", "hour", timedelta(days=1), timedelta(hours=1), "hour"),
    "month": UsageRange("month", "the last 30 days", "day", timedelta(days=30), timedelta(days=1), "day"),
}
DEFAULT_RANGE = "day"
DEFAULT_KIND = "inference"  # applications' calls; "sampling": training pipelines' rollouts (billed apart)
UNAVAILABLE, LIMITED = 503, 429


@dataclass(frozen=True)
class UsageLine:
    """What one adapter revision (or the whole range: `adapter` None in the totals) used, with its 503 and 429."""

    adapter: str | None
    revision: str | None
    counts: UsageCounts
    unavailable: int = 0  # answered 503 (adapter not ready, upstream unavailable)
    limited: int = 0  # answered 429 (rate limit, budget)

    def __add__(self, other: UsageLine) -> UsageLine:
        return UsageLine(
            self.adapter,
            self.revision,
            self.counts + other.counts,
            self.unavailable + other.unavailable,
            self.limited + other.limited,
        )


@dataclass(frozen=True)
class UsagePoint:
    """One bucket of the time series: what started in [start, start + bucket)."""

    start: datetime
    counts: UsageCounts
    unavailable: int
    limited: int


@dataclass(frozen=True)
class UsageView:
    """The tenant's usage (or one adapter's) over a range: the series for the charts, the lines for the table."""

    range: UsageRange
    adapter: str  # "": the whole tenant
    kind: str  # the kind of traffic: inference or sampling
    start: datetime
    end: datetime
    period: str  # the rows read (minute, hour or day)
    points: list[UsagePoint]
    lines: list[UsageLine]
    totals: UsageLine
    truncated: bool

    def chart_json(self) -> dict[str, Any]:
        """The series as the charts read it (usage.js): x in Unix seconds, one list per measure (null: none)."""
        points = self.points
        return {
            "range": self.range.name,
            "label": self.range.label,
            "per": self.range.per,
            "adapter": self.adapter or None,
            "kind": self.kind,
            "bucket_s": int(self.range.bucket.total_seconds()),
            "from": serving_usage.instant_json(self.start),
            "to": serving_usage.instant_json(self.end),
            "period": self.period,
            "x": [int(p.start.timestamp()) for p in points],
            "requests": [p.counts.requests for p in points],
            "prompt_tokens": [p.counts.prompt_tokens for p in points],
            "completion_tokens": [p.counts.completion_tokens for p in points],
            "total_tokens": [p.counts.total_tokens for p in points],
            "latency_p50_ms": [p.counts.latency_p50_ms for p in points],
            "latency_p95_ms": [p.counts.latency_p95_ms for p in points],
            "errors": [p.counts.errors for p in points],
            "unavailable": [p.unavailable for p in points],
            "limited": [p.limited for p in points],
            "totals": {
                **self.totals.counts.as_json(),
                "unavailable": self.totals.unavailable,
                "limited": self.totals.limited,
            },
        }


def _floor(at: datetime, bucket: timedelta) -> datetime:
    """The start of the bucket (a whole multiple of `bucket` since the Unix epoch, UTC) that holds `at`."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((at.astimezone(UTC) - epoch) // bucket) * bucket


def _bucket_start(dimension: str, value: str) -> datetime:
    if dimension == "day":
        return datetime.combine(date.fromisoformat(value), datetime.min.time(), tzinfo=UTC)
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _status_split(counts: UsageCounts, status: int | None) -> tuple[int, int]:
    return (
        counts.requests if status == UNAVAILABLE else 0,
        counts.requests if status == LIMITED else 0,
    )


def _report(
    tenant: Tenant,
    *,
    start: datetime,
    end: datetime,
    group_by: tuple[str, ...],
    adapter: str,
    now: datetime,
    kind: str = DEFAULT_KIND,
) -> UsageReport:
    return serving_usage.usage_report(
        tenant=tenant, start=start, end=end, group_by=group_by, adapter=adapter or None, now=now, kind=kind
    )


def _point(start: datetime, rows: Iterable[serving_usage.UsageRow]) -> UsagePoint:
    """One bucket from a report's rows (one per status)."""
    counts, unavailable, limited = UsageCounts(), 0, 0
    for row in rows:
        counts += row.counts
        n503, n429 = _status_split(row.counts, row.group.get("status"))
        unavailable, limited = unavailable + n503, limited + n429
    return UsagePoint(start, counts, unavailable, limited)


def _series(
    tenant: Tenant, chosen: UsageRange, *, adapter: str, start: datetime, end: datetime, now: datetime, kind: str
) -> tuple[list[UsagePoint], bool]:
    """The series over [start, end) in the range's buckets, empty buckets included (zeros), and whether the
    report was truncated: one report by (time, status), of the adapter's rows only when one is chosen."""
    report = _report(
        tenant, start=start, end=end, group_by=(chosen.dimension, "status"), adapter=adapter, now=now, kind=kind
    )
    by_bucket: dict[datetime, list[serving_usage.UsageRow]] = {}
    for row in report.rows:
        at = _floor(_bucket_start(chosen.dimension, row.group[chosen.dimension]), chosen.bucket)
        by_bucket.setdefault(at, []).append(row)
    points = []
    at = _floor(report.start, chosen.bucket)
    while at < report.end:
        points.append(_point(at, by_bucket.get(at, ())))
        at += chosen.bucket
    return points, report.truncated


def _lines(
    tenant: Tenant, *, adapter: str, start: datetime, end: datetime, now: datetime, kind: str
) -> tuple[list[UsageLine], UsageLine, UsageReport]:
    """Per adapter and revision (their statuses folded in), their totals, and the report they come from."""
    report = _report(tenant, start=start, end=end, group_by=("revision", "status"), adapter=adapter, now=now, kind=kind)
    lines: dict[tuple[str | None, str | None], UsageLine] = {}
    for row in report.rows:
        name, revision = row.group.get("adapter"), row.group.get("revision")
        n503, n429 = _status_split(row.counts, row.group.get("status"))
        line = UsageLine(name, revision, row.counts, n503, n429)
        found = lines.get((name, revision))
        lines[(name, revision)] = line if found is None else found + line
    found_lines = list(lines.values())
    if not report.truncated:
        totals = sum(found_lines, UsageLine(None, None, UsageCounts()))
    else:  # groups were left off: the report's own totals cover them (their 503/429 are not known)
        shown = sum(found_lines, UsageLine(None, None, UsageCounts()))
        totals = UsageLine(None, None, report.totals, shown.unavailable, shown.limited)
    return found_lines, totals, report


def usage_view(
    *,
    tenant: Tenant,
    range_name: str = DEFAULT_RANGE,
    adapter: str = "",
    series: bool = True,
    now=None,
    kind: str = DEFAULT_KIND,
) -> UsageView:
    """The tenant's metered usage of one billed kind (`inference`, applications' calls; `sampling`, training
    pipelines' rollouts) over the range, for one adapter name or all; without `series`, the table only (no
    points: the CSV export).

    Queries: see the module's docstring.
    """
    chosen = USAGE_RANGES[range_name]
    now = now or timezone.now()
    if chosen.name == "hour":
        # Whole slices ending at the next slice boundary: the current minutes are in the last one.
        end = _floor(now, HOUR_SLICE) + HOUR_SLICE
        start = end - HOUR_SLICE * HOUR_SLICES
    else:
        start, end = now - chosen.span, now
    points, series_truncated = (
        _series(tenant, chosen, adapter=adapter, start=start, end=end, now=now, kind=kind) if series else ([], False)
    )
    lines, totals, report = _lines(tenant, adapter=adapter, start=start, end=end, now=now, kind=kind)
    return UsageView(
        range=chosen,
        adapter=adapter,
        kind=kind,
        start=report.start,
        end=report.end,
        period=report.period,
        points=points,
        lines=lines,
        totals=totals,
        truncated=report.truncated or series_truncated,
    )


def usage_adapter_names(*, tenant: Tenant) -> list[str]:
    """The tenant's adapters by name, for the page's adapter switch (1 query)."""
    return list(adapter_selectors.adapter_list(tenant=tenant).order_by("name").values_list("name", flat=True))
