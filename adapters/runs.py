"""Lineage of training runs: the rules for a revision's `run` name and `metrics`, as a trainer registers them.

A trainer that pushes every policy step (an RL loop) names its run and sends what it measured at the step
(loss, reward, KL, …); the API lists a run's revisions in step order with their metrics
(`GET /api/v1/adapters/<name>/runs/<run>/`) and the adapter page draws them. Metrics are the tenant's free-form
numbers, so they are bounded here, before anything is stored: at most MINT_RUN_METRICS_MAX_KEYS names (each a
short identifier) with numbers, booleans, short strings or null, and MINT_RUN_METRICS_MAX_BYTES as JSON.

The rules, and the reads of runs (a run's revisions in step order, a revision's parent chain), live here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, F, Max, Min

from adapters.models import Adapter, AdapterRevision
from mint_site.errors import MintError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
METRIC_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,63}$")
MAX_TEXT = 200  # characters of a string metric (a label, a tag), not a place for documents


def clean_run(value: Any) -> str:
    """A run name (1-64 letters, digits, '.', '_' or '-', starting with a letter or digit), or "" for none."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not RUN_NAME.match(value):
        raise MintError(
            "run: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.",
            code="invalid_run",
            detail={"run": ["not a run name"]},
        )
    return value


def clean_metrics(value: Any) -> dict[str, Any]:
    """A revision's metrics: a JSON object (or its text, as a multipart field sends it) within the bounds."""
    if value is None or value == "":
        return {}
    if isinstance(value, (str, bytes)):
        if len(value) > settings.MINT_RUN_METRICS_MAX_BYTES:
            raise _too_large(len(value))
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid('metrics must be a JSON object, e.g. {"reward": 0.42, "loss": 1.7}.') from None
    if not isinstance(value, dict):
        raise _invalid("metrics must be a JSON object of names to numbers (or booleans, short strings, null).")
    limit = settings.MINT_RUN_METRICS_MAX_KEYS
    if len(value) > limit:
        raise MintError(
            f"metrics: {len(value)} names; at most {limit} (MINT_RUN_METRICS_MAX_KEYS).",
            code="metrics_too_large",
            detail={"metrics": [f"at most {limit} names"]},
        )
    for name, item in value.items():
        if not METRIC_NAME.match(name):
            raise _invalid(f"metrics: {name[:80]!r} is not a metric name (letters, digits, _ . : / -; at most 64).")
        if isinstance(item, float) and not math.isfinite(item):
            raise _invalid(f"metrics.{name}: not a finite number.")
        short_text = isinstance(item, str) and len(item) <= MAX_TEXT
        if not (item is None or isinstance(item, (bool, int, float)) or short_text):
            raise _invalid(f"metrics.{name}: a number, a boolean, null or a string of at most {MAX_TEXT} characters.")
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > settings.MINT_RUN_METRICS_MAX_BYTES:
        raise _too_large(size)
    return value


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a chart can draw: numbers (booleans are not)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _invalid(message: str) -> MintError:
    return MintError(message, code="invalid_metrics", detail={"metrics": [message]})


def _too_large(size: int) -> MintError:
    limit = settings.MINT_RUN_METRICS_MAX_BYTES
    return MintError(
        f"metrics: {size} bytes of JSON; at most {limit} (MINT_RUN_METRICS_MAX_BYTES).",
        code="metrics_too_large",
        detail={"metrics": [f"at most {limit} bytes"]},
    )


# ---------------------------------------------------------------- reads (the runs API, the adapter page)


def run_list(*, adapter: Adapter, limit: int = 100) -> list[dict[str, Any]]:
    """An adapter's runs, the one pushed to last first: name, revisions, first and last step, newest revision."""
    rows = (
        AdapterRevision.objects.filter(adapter=adapter)
        .exclude(run="")
        .values("run")
        .annotate(
            revisions=Count("id"),
            first_step=Min("training_step"),
            last_step=Max("training_step"),
            latest=Max("number"),
            updated_at=Max("created_at"),
        )
        .order_by("-latest")[:limit]
    )
    return list(rows)


def run_revisions(*, adapter: Adapter, run: str, offset: int = 0, limit: int | None = None) -> list[AdapterRevision]:
    """A run's revisions in step order (then by number; revisions without a step last), `limit` from `offset`
    (MINT_RUN_PAGE by default), with their parents (one query, on the index revision_run_steps)."""
    limit = limit or settings.MINT_RUN_PAGE
    revisions = (
        AdapterRevision.objects.filter(adapter=adapter, run=run)
        .select_related("parent")
        .order_by(F("training_step").asc(nulls_last=True), "number")
    )
    return list(revisions[offset : offset + limit])


def parent_chain(*, revision: AdapterRevision, limit: int = 50) -> list[dict[str, Any]]:
    """`revision` and its ancestors by `parent`, newest first, at most `limit` (one recursive query): the lineage
    a trainer declared step by step, across runs (a run resumed from another's revision)."""
    table = AdapterRevision._meta.db_table
    sql = f"""
        WITH RECURSIVE chain(id, number, parent_id, run, training_step, state, depth) AS (
            SELECT id, number, parent_id, run, training_step, state, 0 FROM {table} WHERE id = %s
            UNION ALL
            SELECT r.id, r.number, r.parent_id, r.run, r.training_step, r.state, chain.depth + 1
            FROM {table} r JOIN chain ON r.id = chain.parent_id
            WHERE chain.depth + 1 < %s AND r.adapter_id = %s
        )
        SELECT number, run, training_step, state FROM chain ORDER BY depth
    """  # noqa: S608 - the table name is the model's own; values are parameters
    with connection.cursor() as cursor:
        cursor.execute(sql, [revision.id, limit, revision.adapter_id])
        return [
            {"revision": f"r{number}", "number": number, "run": run, "training_step": step, "state": state}
            for number, run, step, state in cursor.fetchall()
        ]
