"""The catalog benchmark's run: grow the catalog size by size, measure the sizes in interleaved rounds, write
catalog.json and its figure."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import benchmarks.catalog as package
from benchmarks.catalog import DB_NAME, NODES, QUICK_SIZES, SEED, SIZES, TARGET, TENANTS, big_tenant, search_plans
from benchmarks.catalog.db import clone_database, disconnect, drop_database, setup_django, use_database
from benchmarks.catalog.explain import explain_paths, measure_resolution_server, table_sizes
from benchmarks.catalog.load import Catalog
from benchmarks.catalog.measure import (
    SizeState,
    measure_lists,
    measure_registration,
    measure_resolution,
    measure_resolution_queries,
    prepare,
)
from benchmarks.common import parser, summary_ms, write_result
from benchmarks.report.plots import plot_result


def summarize(state: SizeState, plans: list[dict]) -> dict:
    raw = state.raw
    lists = {k: summary_ms(v) for k, v in raw.items() if k.startswith(("revisions_", "adapters_"))}
    return {
        "revisions": state.size,
        "load": state.load,
        "tables": table_sizes(),
        "loadavg_1m": {"min": min(state.loadavg), "max": max(state.loadavg)},
        "resolution": {
            "cold": summary_ms(raw["cold"]),
            "cached": summary_ms(raw["cached"]),
            "queries_only": summary_ms(raw["queries_only"]),
            "distinct_models": len(state.refs),
        },
        "lists": lists,
        "list_p95_ms": max(v["p95_ms"] for v in lists.values()),
        "registration": summary_ms(raw["registration"]),
        "shape": {
            "longest_adapter_revisions": state.targets["longest"][2],
            "oldest_run_revisions": state.targets["oldest_run"][2],
            "median_adapter_revisions": state.targets["median"][2],
            "biggest_tenant_adapters": state.targets["biggest_tenant"][1],
        },
        "plans": plans,
    }


def main() -> int:
    p = parser(package.__doc__)
    p.prog = "python -m benchmarks.catalog"
    p.add_argument("--sizes", help="comma-separated catalog sizes (revisions), e.g. 1000,10000")
    p.add_argument("--keep", action="store_true", help="keep the per-size databases for inspection")
    p.add_argument("--database", default=DB_NAME, help=f"the benchmark's database name (default {DB_NAME})")
    args = p.parse_args()
    db_name = args.database
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    # Per size, over all rounds. The rounds visit every size in turn, so load from other work on
    # the machine falls on every size alike rather than on whichever was measured at the time.
    rounds, cold_n, cached_n, list_n, register_n = (2, 100, 1000, 10, 6) if args.quick else (5, 3000, 20000, 200, 100)
    server_n = 50 if args.quick else 1000
    big_n = 2 if args.quick else 100  # per case, over all rounds
    work = Path(tempfile.mkdtemp(prefix="mint-bench-catalog-"))
    total_started = time.perf_counter()
    states: list[SizeState] = []
    try:
        setup_django(work, db_name)
        catalog = Catalog()
        catalog.create_fixed()
        for size in sizes:
            print(f"catalog: growing to {size} revisions", file=sys.stderr, flush=True)
            started = time.perf_counter()
            load = catalog.grow(size)
            load["total_s"] = round(time.perf_counter() - started, 2)
            database = db_name if size == sizes[-1] else f"{db_name}_{size}"
            if database != db_name:
                clone_database(db_name, database)
            states.append(SizeState(size=size, database=database, load=load))
        load_s = time.perf_counter() - total_started
        rng = np.random.default_rng(SEED + 1)
        for round_ in range(rounds):
            for state in states:
                print(f"catalog: round {round_ + 1}/{rounds} at {state.size}", file=sys.stderr, flush=True)
                use_database(state.database)
                if round_ == 0:
                    prepare(state, rng)
                state.loadavg.append(round(os.getloadavg()[0], 2))
                asyncio.run(
                    measure_resolution(state.refs, state.raw, cold_n=cold_n // rounds, cached_n=cached_n // rounds)
                )
                measure_resolution_queries(state.refs, state.raw["queries_only"], cold_n // rounds)
                measure_lists(state, list_n // rounds)
                measure_registration(state, register_n // rounds, work / "artifacts")
                state.loadavg.append(round(os.getloadavg()[0], 2))
        results = []
        for state in states:
            use_database(state.database)
            results.append(summarize(state, explain_paths(state.targets, state.apis, state.refs[0][::2])))
            r = results[-1]
            r["resolution"]["server_only"] = measure_resolution_server(state.refs, server_n)
            print(
                f"catalog: {state.size}: resolve cold p99 {r['resolution']['cold']['p99_ms']} ms, "
                f"cached p99 {r['resolution']['cached']['p99_ms']} ms, list p95 {r['list_p95_ms']} ms, "
                f"register p95 {r['registration']['p95_ms']} ms",
                file=sys.stderr,
                flush=True,
            )
        # The tenant with 10^5 adapters joins the largest catalog once every size is measured (it would change
        # their shapes): its list and search pages, in rounds as well.
        use_database(db_name)
        print("catalog: one tenant with many adapters", file=sys.stderr, flush=True)
        big = big_tenant.load_big_tenant(catalog, big_tenant.QUICK_ADAPTERS if args.quick else big_tenant.ADAPTERS)
        for round_ in range(rounds):
            print(f"catalog: round {round_ + 1}/{rounds} of the big tenant", file=sys.stderr, flush=True)
            big_tenant.measure_big_tenant(big, big_n // rounds, warm=round_ == 0)
        big_result = big_tenant.summarize(big)
        big_result["search_plans"] = search_plans.explain_searches(big, quick=args.quick)
    finally:
        if states:
            disconnect()
        if not args.keep:
            for state in states:
                if state.database != db_name:
                    drop_database(state.database)
        shutil.rmtree(work, ignore_errors=True)
    first, last = results[0], results[-1]
    figures = {
        "sizes": sizes,
        "tenants": TENANTS,
        "rounds": rounds,
        "nodes": [{"name": n, "state": s, "cpu_slots": c} for n, _, s, c in NODES],
        "results": results,
        "resolution_cold_p99_ratio": round(
            last["resolution"]["cold"]["p99_ms"] / first["resolution"]["cold"]["p99_ms"], 4
        ),
        "resolution_cold_p50_ratio": round(
            last["resolution"]["cold"]["p50_ms"] / first["resolution"]["cold"]["p50_ms"], 4
        ),
        "resolution_queries_p99_ratio": round(
            last["resolution"]["queries_only"]["p99_ms"] / first["resolution"]["queries_only"]["p99_ms"], 4
        ),
        "resolution_server_p99_ratio": round(
            last["resolution"]["server_only"]["p99_ms"] / first["resolution"]["server_only"]["p99_ms"], 4
        ),
        "resolution_cached_p99_ms": max(r["resolution"]["cached"]["p99_ms"] for r in results),
        "list_p95_ms": max(r["list_p95_ms"] for r in results),
        "registration_p95_ms": max(r["registration"]["p95_ms"] for r in results),
        "big_tenant": big_result,
        **{k: big_result[k] for k in big_tenant.KEYS},
        "ratio_sizes": [first["revisions"], last["revisions"]],
        "target": TARGET,
        "load_s": round(load_s, 1),
        "total_s": round(time.perf_counter() - total_started, 1),
        "how": "in-process, one database per size (copies of the growing catalog), measured in interleaved rounds: "
        "resolve() with its caches cleared (cold) or warm (cached), _resolve_sync alone (queries only), "
        "the server's planning + execution time of those queries from EXPLAIN ANALYZE (server only); "
        "DRF APIClient with a pipeline key for the list pages and registration",
    }
    path = write_result("catalog", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(json.dumps({k: v for k, v in figures.items() if k != "results"}, indent=2))
    return 0
