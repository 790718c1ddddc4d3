"""What PostgreSQL does for the big tenant's searches: each search's plan as it runs, and the server's own time for
it (EXPLAIN ANALYZE, the median of REPEATS) under each candidate set of indexes: the measurement behind
adapters/migrations/0013_adapter_name_search.py.

Candidates: none (the tenant's adapters read newest first until a page is full), trigrams of the name (pg_trgm's
GIN), the same led by the tenant (btree_gin), a btree on (tenant, name) for prefixes (`text_pattern_ops`, which a
one- or two-character search uses), and the migration's pair: trigrams led by the tenant and the prefix btree.
"""

from __future__ import annotations

import statistics

from benchmarks.catalog.db import execute
from benchmarks.catalog.explain import plan_summary

# adapters/migrations/0013_adapter_name_search.py: what the catalog runs with, restored after the comparison.
SEARCH_INDEXES = ["adapter_name_trgm", "adapter_name_prefix"]
TRIGRAM = "CREATE INDEX bench_trgm ON adapters_adapter USING gin ((upper(name::text)) gin_trgm_ops)"
TRIGRAM_BY_TENANT = (
    "CREATE INDEX bench_trgm_tenant ON adapters_adapter USING gin (tenant_id, (upper(name::text)) gin_trgm_ops)"
)
PREFIX = "CREATE INDEX bench_prefix ON adapters_adapter (tenant_id, (upper(name::text)) text_pattern_ops)"
CANDIDATES: dict[str, list[str]] = {
    "none": [],
    "trigram": [TRIGRAM],
    "trigram_by_tenant": [TRIGRAM_BY_TENANT],
    "prefix": [PREFIX],
    "trigram_by_tenant_and_prefix": [TRIGRAM_BY_TENANT, PREFIX],  # the migration's pair
}
BENCH_INDEXES = ["bench_trgm", "bench_trgm_tenant", "bench_prefix"]
QUICK_CANDIDATES = ["none", "trigram_by_tenant_and_prefix"]
REPEATS = 7


def search_queries(state) -> dict[str, list[str]]:
    """The SQL of each search's reads of the adapters table, as the API and the overview send them (the probe of
    the newest adapters, the ids of a rare term's matches, the page)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    found = {}
    for label, q in state.searches.items():
        for path, call in (
            ("api", lambda q=q: state.api.get("/api/v1/adapters/", q=q)),
            ("page", lambda q=q: state.page.get("/", {"q": q})),
        ):
            with CaptureQueriesContext(connection) as ctx:
                call()
            found[f"{path}_{label}"] = [s["sql"] for s in ctx.captured_queries if 'FROM "adapters_adapter"' in s["sql"]]
    return found


def _server_ms(queries: list[str], repeats: int) -> tuple[float, list[str]]:
    """The planning + execution time of a search's queries together (EXPLAIN ANALYZE; the median of `repeats`) and
    the indexes they read."""
    times, indexes = [], set()
    for _ in range(repeats):
        total = 0.0
        for sql in queries:
            (plan,) = execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")[0]
            plan = plan[0] if isinstance(plan, list) else plan
            total += plan.get("Planning Time", 0.0) + plan.get("Execution Time", 0.0)
            indexes.update(plan_summary("", sql, plan)["indexes"])
        times.append(total)
    return round(statistics.median(times), 3), sorted(indexes)


def explain_searches(state, *, quick: bool = False) -> dict:
    """The searches' plans with the migration's indexes, and their server time under every candidate set (`quick`:
    no index and the migration's pair, each query once)."""
    searches = search_queries(state)
    plans = []
    for label, queries in searches.items():
        for sql in queries:
            (plan,) = execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")[0]
            plans.append(plan_summary(label, sql, plan[0] if isinstance(plan, list) else plan))
    definitions = [execute("SELECT pg_get_indexdef(%s::regclass)", (name,))[0][0] for name in SEARCH_INDEXES]
    candidates = {}
    try:
        for name, statements in CANDIDATES.items():
            if quick and name not in QUICK_CANDIDATES:
                continue
            _drop_search_indexes()
            for statement in statements:
                execute(statement)
            execute("ANALYZE adapters_adapter")
            timings = {}
            for label, queries in searches.items():
                ms, indexes = _server_ms(queries, 1 if quick else REPEATS)
                timings[label] = {"server_ms": ms, "indexes": indexes}
            candidates[name] = {"searches": timings, "worst_ms": max(t["server_ms"] for t in timings.values())}
    finally:
        _drop_search_indexes()
        for definition in definitions:
            execute(definition)
        execute("ANALYZE adapters_adapter")
    return {"plans": plans, "candidates": candidates}


def _drop_search_indexes() -> None:
    for name in [*SEARCH_INDEXES, *BENCH_INDEXES]:
        execute(f"DROP INDEX IF EXISTS {name}")  # this module's constants, never input
