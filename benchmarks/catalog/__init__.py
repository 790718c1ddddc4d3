"""The catalog at scale: 10^3 … 10^6 revisions over 10^4 tenants in PostgreSQL.

At each size it measures, in-process against its own database:
- the gateway's model resolution (tenant + model string → revision + ready placements,
  serving/gateway/resolve.py): cold (its caches cleared, so the database is asked) and cached;
- the REST list pages (`GET /api/v1/adapters/<name>/revisions/` with cursor pagination, the
  adapters list), through DRF with a pipeline key;
- registration of a new revision from a `source_uri`, through the REST API.
Then a tenant with 10^5 adapters joins the largest catalog (`big_tenant`): its adapter list and search through the
REST API and the dashboard's overview (first pages, pages deep in the list, nine searches from a common word to a
term only other tenants' names hold, the overview's state filters), wall and CPU time per request; and each search's
queries under five sets of indexes (`search_plans`), the measurement behind the search indexes.
It also keeps the `EXPLAIN (ANALYZE, BUFFERS)` of every query those paths run, so a plan that
stops using an index shows up in the results, and the server's own time for the resolution
queries (from EXPLAIN ANALYZE), which the client's scheduling noise does not reach.

The catalog is loaded with COPY and server-side INSERT … SELECT, grows in place from one size
to the next, and is copied (CREATE DATABASE … TEMPLATE) after each size: the sizes are then
measured in interleaved rounds, so load from other work on the machine falls on every size
alike. The 1-minute load average during each size's rounds is recorded. Its shape: tenant sizes
follow a Zipf law (a few tenants with thousands of adapters), revisions per adapter a
log-normal law plus a few long training runs with 10^3-10^4 revisions, most adapters with
a `production` alias (some with a `candidate`, some with an activation in flight), and ready
placements on a few serving nodes (one draining, one down).

Targets: resolution p99 at 10^6 ÷ at 10^3 ≤ 1.2 and cached under 2 ms; list p95 under 50 ms; for the tenant with
10^5 adapters, list and search p95 under 100 ms, API and dashboard.

    python -m benchmarks.catalog [--quick] [--sizes 1000,10000] [--keep] [--database NAME]

The full run takes about 8 minutes on 2 cores (loading 10^6 revisions: 1-2 minutes); --quick
(10^3 and 10^4) about 15 seconds.

Modules: `db` (the benchmark's databases, raw SQL), `load` (generating the catalog), `measure` (the timed
paths), `explain` (query plans, the server's own time), `big_tenant` and `search_plans` (the tenant with 10^5
adapters), `run` (the rounds and the results file).
"""

from __future__ import annotations

SIZES = [10**3, 10**4, 10**5, 10**6]
QUICK_SIZES = [10**3, 10**4]
TENANTS = 10_000
SEED = 20261130
DB_NAME = "mint_bench_catalog"
REDIS_DB = 11  # registration uses 14, the serving stack 13, live_events 12
TARGET = {
    "resolution_p99_ratio": 1.2,
    "resolution_cached_p99_ms": 2.0,
    "list_p95_ms": 50.0,
    # One tenant with 10^5 adapters (big_tenant): server time of its list and search, API and dashboard.
    "adapter_list_p95_ms": 100.0,
    "adapter_search_p95_ms": 100.0,
    "dashboard_list_p95_ms": 100.0,
    "dashboard_search_p95_ms": 100.0,
}

# Serving nodes: (name, base model index, state, cpu_slots).
NODES = [
    ("gpu-d1", 0, "up", 256),
    ("gpu-d2", 0, "up", 256),
    ("gpu-d3", 0, "up", 256),
    ("gpu-d4", 0, "draining", 256),
    ("gpu-m1", 1, "up", 128),
    ("gpu-m2", 1, "down", 128),
]
WORDS = ["support", "summarize", "code", "sql", "legal", "triage", "translate", "search", "chat", "extract"]
