"""Reads of metered usage (`serving.models.UsageRecord`): requests, errors, tokens and latency summed per group
over a range of time, for the usage API (`GET /api/v1/usage/`) and the dashboard.

One period per answer. Every request is counted in a minute, an hour and a day row, so an answer that mixed
periods would count it twice: it reads minute rows for a range of at most USAGE_MINUTE_RANGE that starts within
their retention (MINT_USAGE_MINUTE_RETENTION_DAYS), else hour rows if the range starts within theirs
(MINT_USAGE_HOUR_RETENTION_DAYS), else day rows, which are kept for good (`usage_period`). The purge (hourly)
deletes only rows that started before now minus the retention, so the rows chosen are all still there. A row
counts when its period starts in [from, to): the answer's `start` and `end` are `from` and `to` rounded up to
the period, the instants it covers exactly.

Latency percentiles come from the summed fixed-bucket histogram (`lat_0` …, against LATENCY_BOUNDS_MS) by
linear interpolation inside the bucket the rank falls in, as Prometheus' `histogram_quantile` does: exact at a
bucket's bounds, at most that bucket's width off inside it. A rank in the last bucket (slower than the last
bound) is reported as that bound, a lower bound of the truth.

Bounded cost: one aggregate query (GROUP BY in SQL over the period's index, the `lat_*` columns summed) that
fetches at most USAGE_MAX_GROUPS + 1 groups; one more to name the keys when grouped by key, and one more for
the totals when groups were left off (`truncated`). A range is at most USAGE_MAX_RANGE_DAYS long.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, Q, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour, TruncMinute
from django.utils import timezone

from mint_site.errors import MintError
from serving.models import LATENCY_BOUNDS_MS, LATENCY_BUCKETS, UsageKind, UsagePeriod, UsageRecord
from tenants.models import ApiKey, Tenant

# What `group_by` may name (one or two of them). `revision` groups by adapter and revision: a revision number
# alone names nothing.
USAGE_DIMENSIONS = ("adapter", "revision", "key", "day", "hour", "minute", "node", "status")
_TIME_DIMENSIONS = ("day", "hour", "minute")
USAGE_KINDS = (
    UsageKind.INFERENCE.value,
    UsageKind.SAMPLING.value,
    UsageKind.EVALUATION.value,
    UsageKind.WARMUP.value,
    "all",
)
USAGE_MAX_RANGE_DAYS = 400
USAGE_MAX_GROUPS = 10_000
USAGE_MINUTE_RANGE = timedelta(days=2)
USAGE_DEFAULT_RANGE = timedelta(hours=24)

# The fields each dimension adds to a row, in order.
_COLUMNS = {
    "tenant": ("tenant",),
    "adapter": ("adapter",),
    "revision": ("adapter", "revision"),
    "key": ("key", "key_id"),
    "day": ("day",),
    "hour": ("hour",),
    "minute": ("minute",),
    "node": ("node",),
    "status": ("status",),
}
# What each row field is grouped by in SQL (an alias that names no model field).
_GROUP_EXPRESSIONS = {
    "tenant": lambda: F("tenant__slug"),
    "tenant_id": lambda: F("tenant_id"),
    "adapter": lambda: F("adapter_name"),
    "revision": lambda: F("revision"),
    "key_id": lambda: F("key_id"),
    "day": lambda: TruncDay("start", tzinfo=UTC),
    "hour": lambda: TruncHour("start", tzinfo=UTC),
    "minute": lambda: TruncMinute("start", tzinfo=UTC),
    "node": lambda: F("node"),
    "status": lambda: F("status"),
}
_STEP = {UsagePeriod.MINUTE: timedelta(minutes=1), UsagePeriod.HOUR: timedelta(hours=1), UsagePeriod.DAY: timedelta(1)}
_SUMS = ("requests", "prompt_tokens", "completion_tokens", "latency_ms_sum", *LATENCY_BUCKETS, "cold_starts")


def _sums() -> dict[str, Sum]:
    sums = {f"s_{name}": Sum(name) for name in _SUMS}
    sums["s_errors"] = Sum("requests", filter=Q(status__gte=400))
    return sums


def instant_json(at: datetime) -> str:
    """An instant as the API writes it: ISO-8601 in UTC, with `Z`."""
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def histogram_quantile(q: float, histogram: tuple[int, ...]) -> float | None:
    """The q-quantile (0 < q ≤ 1) of latencies counted in LATENCY_BOUNDS_MS buckets (see the module's docstring)."""
    total = sum(histogram)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(histogram):
        if count and below + count >= rank:
            if index == len(LATENCY_BOUNDS_MS):
                return float(LATENCY_BOUNDS_MS[-1])
            lower = LATENCY_BOUNDS_MS[index - 1] if index else 0
            upper = LATENCY_BOUNDS_MS[index]
            return lower + (upper - lower) * (rank - below) / count
        below += count
    return float(LATENCY_BOUNDS_MS[-1])  # not reached: the ranks add up to `total`


def _ms(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


@dataclass(frozen=True)
class UsageCounts:
    """What a group (or a whole answer) used: requests, those answered with a status ≥ 400, tokens, latency."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms_sum: float = 0.0
    histogram: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS)
    cold_starts: int = 0  # loads on demand its requests started

    @classmethod
    def of(cls, sums: dict[str, Any]) -> UsageCounts:
        """From one row of `_sums()` (a SUM over no rows is NULL: 0)."""
        return cls(
            requests=int(sums["s_requests"] or 0),
            errors=int(sums["s_errors"] or 0),
            prompt_tokens=int(sums["s_prompt_tokens"] or 0),
            completion_tokens=int(sums["s_completion_tokens"] or 0),
            latency_ms_sum=float(sums["s_latency_ms_sum"] or 0),
            histogram=tuple(int(sums[f"s_{name}"] or 0) for name in LATENCY_BUCKETS),
            cold_starts=int(sums["s_cold_starts"] or 0),
        )

    def __add__(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(
            requests=self.requests + other.requests,
            errors=self.errors + other.errors,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            latency_ms_sum=self.latency_ms_sum + other.latency_ms_sum,
            histogram=tuple(a + b for a, b in zip(self.histogram, other.histogram, strict=True)),
            cold_starts=self.cold_starts + other.cold_starts,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def latency_p50_ms(self) -> float | None:
        return _ms(histogram_quantile(0.5, self.histogram))

    @property
    def latency_p95_ms(self) -> float | None:
        return _ms(histogram_quantile(0.95, self.histogram))

    @property
    def latency_mean_ms(self) -> float | None:
        return _ms(self.latency_ms_sum / self.requests) if self.requests else None

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p95_ms": self.latency_p95_ms,
            "latency_mean_ms": self.latency_mean_ms,
            "cold_starts": self.cold_starts,
        }


COUNT_COLUMNS = tuple(UsageCounts().as_json())


@dataclass(frozen=True)
class UsageRow:
    """One group: its fields (`UsageReport.columns`: adapter name, `r<n>`, key prefix, …) and what it used."""

    group: dict[str, Any]
    counts: UsageCounts

    def as_json(self) -> dict[str, Any]:
        return {**self.group, **self.counts.as_json()}


@dataclass(frozen=True)
class UsageReport:
    """Usage over [start, end) from one period's rows, per group; `totals` over the whole range, whatever was
    left off (`truncated`: there were more than `max_groups` groups; `rows` has the first ones in order)."""

    tenant: str | None  # the tenant read; None: every tenant (the platform view)
    start: datetime
    end: datetime
    period: str
    kind: str
    group_by: tuple[str, ...]
    columns: tuple[str, ...]
    rows: list[UsageRow]
    totals: UsageCounts
    truncated: bool
    max_groups: int = USAGE_MAX_GROUPS

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "from": instant_json(self.start),
            "to": instant_json(self.end),
            "period": self.period,
            "kind": self.kind,
            "group_by": list(self.group_by),
            "columns": list(self.columns),
            "rows": [row.as_json() for row in self.rows],
            "totals": self.totals.as_json(),
            "truncated": self.truncated,
            "max_groups": self.max_groups,
        }


def usage_window(*, start: datetime | None, end: datetime | None, now: datetime) -> tuple[datetime, datetime]:
    """The range asked for, with the defaults (`to` now, `from` USAGE_DEFAULT_RANGE before `to`) and its bounds:
    `to` after `from` and at most USAGE_MAX_RANGE_DAYS later (400 `range_too_long`)."""
    end = end if end is not None else now
    start = start if start is not None else end - USAGE_DEFAULT_RANGE
    if end <= start:
        message = f"must be after from ({instant_json(start)})"
        raise MintError(f"to: {message}.", detail={"to": [message]})
    if end - start > timedelta(days=USAGE_MAX_RANGE_DAYS):
        days = (end - start) / timedelta(days=1)
        raise MintError(
            f"from {instant_json(start)} to {instant_json(end)} is {days:.1f} days; one answer covers at most "
            f"{USAGE_MAX_RANGE_DAYS} days: ask for several ranges.",
            code="range_too_long",
            detail={"max_days": USAGE_MAX_RANGE_DAYS},
        )
    return start, end


def usage_period(*, start: datetime, end: datetime, now: datetime) -> str:
    """The one period whose rows an answer over [start, end) reads (see the module's docstring)."""
    if end - start <= USAGE_MINUTE_RANGE and start >= now - timedelta(days=settings.MINT_USAGE_MINUTE_RETENTION_DAYS):
        return UsagePeriod.MINUTE
    if start >= now - timedelta(days=settings.MINT_USAGE_HOUR_RETENTION_DAYS):
        return UsagePeriod.HOUR
    return UsagePeriod.DAY


def _ceil(at: datetime, period: str) -> datetime:
    """The first period start at or after `at` (UTC)."""
    at = at.astimezone(UTC)
    floor = at.replace(second=0, microsecond=0)
    if period in (UsagePeriod.HOUR, UsagePeriod.DAY):
        floor = floor.replace(minute=0)
    if period == UsagePeriod.DAY:
        floor = floor.replace(hour=0)
    return floor if floor == at else floor + _STEP[period]


def _dimensions(group_by: tuple[str, ...] | list[str], period: str) -> tuple[str, ...]:
    """`group_by` checked: one or two known dimensions, not both day and hour, none finer than the rows read."""
    dims = tuple(group_by)

    def refuse(message: str, code: str = "invalid_request") -> MintError:
        return MintError(f"group_by: {message}", code=code, detail={"group_by": [message]})

    unknown = [d for d in dims if d not in USAGE_DIMENSIONS]
    if unknown:
        raise refuse(f"unknown dimension {unknown[0]!r}; one or two of {', '.join(USAGE_DIMENSIONS)}.")
    if not 1 <= len(dims) <= 2 or len(set(dims)) != len(dims):
        raise refuse(f"name one or two different dimensions (comma-separated), not {','.join(dims) or 'none'}.")
    if len(set(dims) & set(_TIME_DIMENSIONS)) > 1:
        raise refuse("group by one of day, hour or minute, not two.")
    if "minute" in dims and period != UsagePeriod.MINUTE:
        raise refuse(
            f"minute rows are read for a range of at most {USAGE_MINUTE_RANGE.days} days that starts within the last "
            f"{settings.MINT_USAGE_MINUTE_RETENTION_DAYS} (MINT_USAGE_MINUTE_RETENTION_DAYS); this one is read from "
            f"{period} rows: group by hour or day, or ask for a shorter, later range.",
            code="group_by_unavailable",
        )
    if "hour" in dims and period == UsagePeriod.DAY:
        raise refuse(
            f"hour rows are kept {settings.MINT_USAGE_HOUR_RETENTION_DAYS} days (MINT_USAGE_HOUR_RETENTION_DAYS) "
            "and this range starts earlier, so it is read from day rows: group by day, or ask for a later range.",
            code="group_by_unavailable",
        )
    return dims


def _records(
    *, tenant: Tenant | None, period: str, start: datetime, end: datetime, kind: str, adapter: str | None
) -> QuerySet:
    records = UsageRecord.objects.filter(period=period, start__gte=start, start__lt=end)
    if tenant is not None:
        records = records.filter(tenant=tenant)
    if adapter is not None:
        records = records.filter(adapter_name=adapter)
    if kind != "all":
        records = records.filter(kind=kind)
    return records


def _key_prefixes(ids: set[int], *, tenant: Tenant | None) -> dict[int, tuple[int, str]]:
    """Key id → (its tenant's id, its prefix), for the keys that still exist (of `tenant`, if one is named)."""
    if not ids:
        return {}
    keys = ApiKey.objects.filter(id__in=ids)
    if tenant is not None:
        keys = keys.filter(tenant=tenant)
    return {key_id: (tenant_id, prefix) for key_id, tenant_id, prefix in keys.values_list("id", "tenant_id", "prefix")}


def _group_value(name: str, value: Any) -> Any:
    if name == "day":
        return value.astimezone(UTC).date().isoformat()
    if name in ("hour", "minute"):
        return instant_json(value)
    if name == "revision":
        return f"r{value}" if value else None
    if name in ("adapter", "node"):
        return value or None
    return value


def usage_report(
    *,
    tenant: Tenant | None,
    platform: bool = False,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: tuple[str, ...] | list[str] = ("adapter",),
    kind: str = UsageKind.INFERENCE,
    adapter: str | None = None,
    now: datetime | None = None,
    max_groups: int = USAGE_MAX_GROUPS,
) -> UsageReport:
    """Usage of `tenant` over [start, end) (default: the last 24 h) per group of `group_by`, of one `kind`
    (`inference`, applications' calls, by default; `sampling`, a pipeline's rollouts, billed too; `warmup`,
    MinT's own; or `all`), of one adapter (by name) or all.

    `platform=True` is the view of platform staff (the caller checks who may have it): each row names its
    tenant, and `tenant=None` reads every tenant (it needs `platform`). Refusals are `MintError`s naming the
    field: `to` not after `from`, a range past USAGE_MAX_RANGE_DAYS (`range_too_long`), an unknown `group_by`,
    or `hour` (`minute`) where only day (hour) rows cover the range (`group_by_unavailable`). Queries: see the
    module's docstring.
    """
    if tenant is None and not platform:
        raise ValueError("usage_report: name a tenant, or ask for the platform view (platform=True)")
    if kind not in USAGE_KINDS:
        raise MintError(f"kind: one of {', '.join(USAGE_KINDS)}.", detail={"kind": [f"not one of {USAGE_KINDS}"]})
    now = now or timezone.now()
    start, end = usage_window(start=start, end=end, now=now)
    period = usage_period(start=start, end=end, now=now)
    dims = _dimensions(group_by, period)
    start, end = _ceil(start, period), _ceil(end, period)

    columns: list[str] = []
    for dim in (("tenant",) if platform else ()) + dims:
        columns += [c for c in _COLUMNS[dim] if c not in columns]
    grouped = [c if c != "key" else "key_id" for c in columns if c != "key_id"]
    if platform and "key_id" in grouped:
        grouped.append("tenant_id")  # a key is named only by its own tenant's rows
    aliases = {f"g_{name}": _GROUP_EXPRESSIONS[name]() for name in grouped}

    records = _records(tenant=tenant, period=period, start=start, end=end, kind=kind, adapter=adapter)
    found = list(records.values(**aliases).annotate(**_sums()).order_by(*aliases)[: max_groups + 1])
    truncated = len(found) > max_groups
    found = found[:max_groups]

    keys = _key_prefixes({g["g_key_id"] for g in found if g.get("g_key_id")}, tenant=tenant) if "key" in dims else {}
    rows = []
    for values in found:
        group: dict[str, Any] = {}
        for column in columns:
            if column == "key":
                key_id = values["g_key_id"]
                owner = tenant.id if tenant is not None else values["g_tenant_id"]
                known = keys.get(key_id)
                group["key"] = known[1] if known is not None and known[0] == owner else None
            elif column == "key_id":
                group["key_id"] = values["g_key_id"] or None
            else:
                group[column] = _group_value(column, values[f"g_{column}"])
        rows.append(UsageRow(group=group, counts=UsageCounts.of(values)))

    if truncated:
        totals = UsageCounts.of(records.aggregate(**_sums()))
    else:
        totals = sum((row.counts for row in rows), UsageCounts())
    return UsageReport(
        tenant=tenant.slug if tenant is not None else None,
        start=start,
        end=end,
        period=period,
        kind=kind,
        group_by=dims,
        columns=tuple(columns),
        rows=rows,
        totals=totals,
        truncated=truncated,
        max_groups=max_groups,
    )


def usage_tenant_named(slug: str) -> Tenant | None:
    """The tenant a staff member's `?tenant=` names, or None."""
    return Tenant.objects.filter(slug=slug).first()
