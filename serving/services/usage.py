"""Writes of metered usage: the gateway's per-minute counts added to their minute, hour and day rows, and the
purge of rows past their retention.

Each flush is one transaction of upserts that add to what the rows hold (`INSERT … ON CONFLICT … DO UPDATE
SET n = n + excluded.n`, on PostgreSQL and SQLite alike), so any number of gateway processes may flush the
same rows at once and nothing is counted twice or lost between them: a flush that fails leaves the counts with
the process that tried, for its next flush (serving/gateway/metering.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from serving.models import LATENCY_BOUNDS_MS, USAGE_COUNTS, Placement, UsageKind, UsagePeriod, UsageRecord

# (minute start, kind, tenant id, key id, adapter id, adapter name, revision number, node, status)
UsageKey = tuple[datetime, str, int, int, int, str, int, str, int]
_CHUNK = 400


def _starts(minute: datetime) -> tuple[tuple[str, datetime], ...]:
    return (
        (UsagePeriod.MINUTE, minute),
        (UsagePeriod.HOUR, minute.replace(minute=0)),
        (UsagePeriod.DAY, minute.replace(hour=0, minute=0)),
    )


def _rows(counts: Mapping[UsageKey, Sequence[float]]) -> list[tuple]:
    """Each key's counts in its minute, hour and day rows, merged where keys share a row (an upsert may touch a
    row once per statement)."""
    merged: dict[tuple, list] = {}
    for (minute, kind, tenant, key, adapter, name, revision, node, status), values in counts.items():
        for period, start in _starts(minute.replace(second=0, microsecond=0)):
            row_key = (period, start, kind, tenant, key, adapter, revision, node, status)
            found = merged.get(row_key)
            if found is None:
                merged[row_key] = [name, *values]
            else:
                found[1:] = [a + b for a, b in zip(found[1:], values, strict=True)]
    return [(*row_key, *rest) for row_key, rest in merged.items()]


def usage_add(*, counts: Mapping[UsageKey, Sequence[float]]) -> int:
    """Add metered counts (each in USAGE_COUNTS order) to their minute, hour and day rows; returns rows written."""
    rows = _rows(counts)
    if not rows:
        return 0
    table = connection.ops.quote_name(UsageRecord._meta.db_table)
    columns = (
        "period",
        "start",
        "kind",
        "tenant_id",
        "key_id",
        "adapter_id",
        "revision",
        "node",
        "status",
        "adapter_name",
        *USAGE_COUNTS,
    )
    target = "period, start, kind, tenant_id, key_id, adapter_id, revision, node, status"
    updates = ", ".join(
        ["adapter_name = excluded.adapter_name"]
        + [f"{name} = {table}.{name} + excluded.{name}" for name in USAGE_COUNTS]
    )
    placeholders = "(" + ", ".join(["%s"] * len(columns)) + ")"
    adapt = connection.ops.adapt_datetimefield_value
    with transaction.atomic(), connection.cursor() as cursor:
        for first in range(0, len(rows), _CHUNK):
            chunk = rows[first : first + _CHUNK]
            params: list = []
            for period, start, *rest in chunk:
                params += [period, adapt(start), *rest]
            cursor.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([placeholders] * len(chunk))} "  # noqa: S608
                f"ON CONFLICT ({target}) DO UPDATE SET {updates}",
                params,
            )
    return len(rows)


def usage_purge(*, now: datetime | None = None) -> dict[str, int]:
    """Delete minute and hour rows past their retention (MINT_USAGE_MINUTE_RETENTION_DAYS, …_HOUR_…); day rows stay."""
    now = now or timezone.now()
    purged = {}
    for period, days in (
        (UsagePeriod.MINUTE, settings.MINT_USAGE_MINUTE_RETENTION_DAYS),
        (UsagePeriod.HOUR, settings.MINT_USAGE_HOUR_RETENTION_DAYS),
    ):
        purged[period] = UsageRecord.objects.filter(period=period, start__lt=now - timedelta(days=days)).delete()[0]
    return purged


def minute_of(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def usage_of_warmup(*, placement: Placement, answer: dict, ms: float) -> int:
    """Meter a prewarm's warm-up completion as MinT's own traffic (`warmup`: never billed to the tenant)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return usage_of_revision(
        kind=UsageKind.WARMUP,
        revision=placement.revision,
        node=placement.node.name,
        requests=1,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        latencies_ms=[ms],
    )


def usage_of_revision(
    *,
    kind: str,
    revision,
    node: str,
    requests: int,
    prompt_tokens: int,
    completion_tokens: int,
    latencies_ms: Sequence[float],
    status: int = 200,
) -> int:
    """Meter completions of `revision` on `node` sent by no key: the playground's (the tenant's inference), an
    evaluation's or a prewarm's (MinT's own traffic, never billed to the tenant)."""
    values = [0.0] * len(USAGE_COUNTS)
    values[0], values[1], values[2], values[3] = requests, prompt_tokens, completion_tokens, sum(latencies_ms)
    for ms in latencies_ms:
        values[USAGE_COUNTS.index("lat_0") + bisect.bisect_left(LATENCY_BOUNDS_MS, ms)] += 1
    key = (
        minute_of(timezone.now()),
        kind,
        revision.adapter.tenant_id,
        0,
        revision.adapter_id,
        revision.adapter.name,
        revision.number,
        node,
        status,
    )
    return usage_add(counts={key: values})
