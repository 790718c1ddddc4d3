"""What the database does for the measured paths: EXPLAIN (ANALYZE, BUFFERS) of each query, the server's own
time for a resolution's queries, and the tables' sizes."""

from __future__ import annotations

from benchmarks.catalog.db import execute
from benchmarks.catalog.measure import Api, list_cases
from benchmarks.common import summary_ms


def measure_resolution_server(refs: list, n: int) -> dict:
    """The database server's own time for a cold resolution's queries (planning + execution, from EXPLAIN
    ANALYZE), summed per resolution: what the catalog's size can change, without the client's scheduling noise."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from serving.gateway import resolve as gateway

    timings = []
    for i in range(n):
        tenant_id, ref, _ = refs[i % len(refs)]
        with CaptureQueriesContext(connection) as ctx:
            gateway._resolve_sync(tenant_id, ref)
        total = 0.0
        for query in ctx.captured_queries:
            (plan,) = execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {query['sql']}")[0]
            plan = plan[0] if isinstance(plan, list) else plan
            total += plan.get("Planning Time", 0.0) + plan.get("Execution Time", 0.0)
        timings.append(total / 1000)
    return summary_ms(timings)


def explain_paths(targets: dict, apis: dict[int, Api], probe: tuple[int, str]) -> list[dict]:
    """EXPLAIN (ANALYZE, BUFFERS) of every SELECT the measured paths run, with the indexes each plan uses."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from serving.gateway import resolve as gateway

    captured: list[tuple[str, str]] = []

    def capture(label: str, call) -> None:
        with CaptureQueriesContext(connection) as ctx:
            call()
        captured.extend(
            (label, q["sql"]) for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("SELECT")
        )

    tenant_id, model = probe
    ref = gateway.parse_model(model)
    pinned = execute(
        """
        SELECT a.tenant_id, a.name || '@r' || r.number FROM serving_placement p
        JOIN adapters_adapterrevision r ON r.id = p.revision_id JOIN adapters_adapter a ON a.id = r.adapter_id
        WHERE p.state = 'ready' AND r.state = 'approved' ORDER BY p.id LIMIT 1
        """
    )
    capture("resolve", lambda: gateway._resolve_sync(tenant_id, ref))
    for tenant_id, model in pinned:
        capture("resolve_pinned", lambda t=tenant_id, m=model: gateway._resolve_sync(t, gateway.parse_model(m)))
    for name, tenant_id, url, params in list_cases(targets):
        capture(name, lambda t=tenant_id, u=url, q=params: apis[t].get(u, **q))
    longest_tenant, longest, _ = targets["longest"]
    _, first = apis[longest_tenant].get(f"/api/v1/adapters/{longest}/revisions/")
    if first.get("next"):
        capture("revisions_cursor_page", lambda: apis[longest_tenant].get(first["next"]))
    plans, seen = [], set()
    for label, sql in captured:
        if sql in seen:
            continue
        seen.add(sql)
        (plan,) = execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")[0]
        plans.append(plan_summary(label, sql, plan[0] if isinstance(plan, list) else plan))
    return plans


def plan_summary(label: str, sql: str, plan: dict) -> dict:
    nodes, indexes, seq_scans, rows_removed = [], [], [], 0

    def walk(node: dict) -> None:
        nonlocal rows_removed
        kind = node["Node Type"]
        nodes.append(kind)
        if "Index Name" in node:
            indexes.append(node["Index Name"])
        if kind == "Seq Scan":
            seq_scans.append(node.get("Relation Name", "?"))
        rows_removed += int(node.get("Rows Removed by Filter", 0))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    top = plan["Plan"]
    return {
        "path": label,
        "sql": " ".join(sql.split())[:400],
        "nodes": nodes,
        "indexes": indexes,
        "seq_scans": seq_scans,  # small tables (nodes, base models, users) are rightly read whole
        "sort": any(n in ("Sort", "Incremental Sort") for n in nodes),
        "rows_removed_by_filter": rows_removed,
        "buffers": int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)),
        "execution_ms": round(plan.get("Execution Time", 0.0), 3),
    }


def table_sizes() -> dict:
    rows = execute(
        """
        SELECT c.relname, c.reltuples::bigint, pg_total_relation_size(c.oid) FROM pg_class c
        WHERE c.relname IN ('tenants_tenant', 'adapters_adapter', 'adapters_adapterrevision', 'serving_alias',
                            'serving_placement')
        """
    )
    return {name: {"rows": int(rows_), "bytes": int(size)} for name, rows_, size in rows}
