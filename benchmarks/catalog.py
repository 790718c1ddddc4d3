"""The catalog at scale: 10^3 … 10^6 revisions over 10^4 tenants in PostgreSQL.

At each size it measures, in-process against its own database:
- the gateway's model resolution (tenant + model string → revision + ready placements,
  serving/gateway/resolve.py): cold (its caches cleared, so the database is asked) and cached;
- the REST list pages (`GET /api/v1/adapters/<name>/revisions/` with cursor pagination, the
  adapters list), through DRF with a pipeline key;
- registration of a new revision from a `source_uri`, through the REST API.
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

Targets: resolution p99 at 10^6 ÷ at 10^3 ≤ 1.2 and cached under 2 ms; list p95 under 50 ms.

    python -m benchmarks.catalog [--quick] [--sizes 1000,10000] [--keep] [--database NAME]

The full run takes about 8 minutes on 2 cores (loading 10^6 revisions: 1-2 minutes); --quick
(10^3 and 10^4) about 15 seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from benchmarks.common import bench_database_url, parser, recreate_database, summary_ms, write_result

SIZES = [10**3, 10**4, 10**5, 10**6]
QUICK_SIZES = [10**3, 10**4]
TENANTS = 10_000
SEED = 20261130
DB_NAME = "mint_bench_catalog"
REDIS_DB = 11  # registration uses 14, the serving stack 13, live_events 12
TARGET = {"resolution_p99_ratio": 1.2, "resolution_cached_p99_ms": 2.0, "list_p95_ms": 50.0}

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


# ---------------------------------------------------------------------------------------------
# Setting up Django on the benchmark's own database


def setup_django(work: Path) -> str:
    db_url = bench_database_url(DB_NAME)
    recreate_database(db_url)
    redis = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
    os.environ.update(
        {
            "DATABASE_URL": db_url,
            "REDIS_URL": f"{redis}/{REDIS_DB}",
            "MINT_VAR_DIR": str(work / "var"),
            "MINT_ARTIFACT_ROOT": str(work / "artifacts"),
            "MINT_LOG_LEVEL": "ERROR",
        }
    )
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    # The test client's host; and a resolution cache that outlives the cached measurement.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    settings.MINT_GATEWAY_CACHE_S = 3600.0
    flush_redis()
    return db_url


def flush_redis() -> None:
    from mint_site.celery import app

    with app.connection_for_write() as conn:
        conn.default_channel.client.flushdb()  # the validations registration queued; no worker runs here


# ---------------------------------------------------------------------------------------------
# Loading the catalog


def raw_connection():
    from django.db import connection

    connection.ensure_connection()
    return connection.connection


def copy_rows(table: str, columns: list[str], rows) -> int:
    """COPY rows (tuples; None is NULL) into a table. Returns how many."""
    count = 0
    with raw_connection().cursor() as cur, cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
            count += 1
    return count


def execute(sql: str, params=None) -> list[tuple]:
    with raw_connection().cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


def reset_sequences(*tables: str) -> None:
    for table in tables:
        # Table names are this module's constants, never input.
        execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), COALESCE((SELECT max(id) FROM {table}), 1))")  # noqa: S608


class Catalog:
    """Grows the catalog in place; remembers what the measurements need."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(SEED)
        self.revisions = 0
        self.adapters = 0
        # Zipf-distributed tenant weights, shuffled so the big tenants are not simply the first ids.
        weights = 1.0 / np.arange(1, TENANTS + 1) ** 1.05
        self.tenant_weights = weights / weights.sum()
        self.tenant_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self.base_ids: list[int] = []
        self.node_ids: dict[str, int] = {}

    def create_fixed(self) -> None:
        """Tenants (COPY), base models and serving nodes (ORM)."""
        from django.utils import timezone

        from adapters.models import BaseModel
        from serving.models import ServingNode

        now = timezone.now()
        copy_rows(
            "tenants_tenant",
            [
                "slug",
                "name",
                "is_active",
                "max_adapters",
                "max_ready_revisions",
                "rate_limit_rpm",
                "max_upload_bytes",
                "four_eyes",
                "created_at",
            ],
            (
                (f"tenant-{i:05d}", f"Tenant {i}", i % 500 != 7, 100_000, 64, 600, 512 * 2**20, True, now)
                for i in range(TENANTS)
            ),
        )
        ids = [row[0] for row in execute("SELECT id FROM tenants_tenant ORDER BY id")]
        self.tenant_ids = np.array(ids, dtype=np.int64)
        self.rng.shuffle(self.tenant_ids)  # tenant_ids[0] is the biggest tenant
        execute("UPDATE tenants_tenant SET is_active = true WHERE id = ANY(%s)", (self.tenant_ids[:200].tolist(),))
        shapes = {"q_proj": [64, 64], "v_proj": [64, 32]}
        for name, arch, experts in (("llama-3-8b", "dense", 0), ("qwen3-30b-a3b", "moe", 128)):
            config = {
                "architecture": arch,
                "num_layers": 48 if arch == "moe" else 32,
                "num_experts": experts,
                "module_shapes": shapes,
                "expert_module_shapes": {},
            }
            base = BaseModel.objects.create(name=name, architecture=arch, max_lora_rank=64, config=config)
            self.base_ids.append(base.id)
        for index, (name, base, state, cpu_slots) in enumerate(NODES):
            node = ServingNode.objects.create(
                name=name,
                base_model_id=self.base_ids[base],
                url=f"http://10.0.0.{index + 10}:8000",
                served_model_name="base",
                state=state,
                gpu_slots=32,
                cpu_slots=cpu_slots,
                cache_dir="/var/cache/mint",
            )
            self.node_ids[name] = node.id

    def _revision_counts(self, add: int) -> list[int]:
        """Revisions per new adapter: a few long training runs, then a log-normal body."""
        counts: list[int] = []
        if add >= 5_000:
            counts.append(min(add // 20, 20_000))  # one very long run
            counts += [max(add // 400, 50)] * 10  # a few long ones
        remaining = add - sum(counts)
        while remaining > 0:
            body = np.ceil(self.rng.lognormal(mean=1.2, sigma=1.1, size=max(remaining // 4, 16))).astype(int)
            for k in body.clip(1, 500):
                k = min(int(k), remaining)
                counts.append(k)
                remaining -= k
                if remaining == 0:
                    break
        return counts

    def grow(self, size: int) -> dict:
        """Add adapters, revisions and aliases up to `size` revisions; re-place; ANALYZE. Returns timings."""
        timings: dict[str, float] = {}
        add = size - self.revisions
        counts = self._revision_counts(add)
        first = self.adapters + 1
        started = time.perf_counter()
        tenants = self.rng.choice(self.tenant_ids, size=len(counts), p=self.tenant_weights)
        tenants[: min(11, len(counts))] = self.tenant_ids[: min(11, len(counts))]  # long runs in big tenants
        bases = np.where(self.rng.random(len(counts)) < 0.15, self.base_ids[1], self.base_ids[0])
        starts = self.rng.uniform(0, 365 * 86400, size=len(counts))
        base_time = time.time() - 400 * 86400

        def adapter_rows():
            for i, k in enumerate(counts):
                adapter_id = first + i
                name = f"{WORDS[adapter_id % len(WORDS)]}-{adapter_id}"
                created = _ts(base_time + starts[i])
                yield (adapter_id, name, "", created, k, int(tenants[i]), int(bases[i]))

        copy_rows(
            "adapters_adapter",
            ["id", "name", "description", "created_at", "revision_counter", "tenant_id", "base_model_id"],
            adapter_rows(),
        )
        last = first + len(counts) - 1
        timings["adapters_s"] = time.perf_counter() - started

        # Revisions are generated in the server, interleaved in time across adapters as real
        # registrations are (an adapter's revisions end up scattered over the heap).
        started = time.perf_counter()
        execute(REVISIONS_SQL, {"lo": first, "hi": last})
        timings["revisions_s"] = time.perf_counter() - started
        started = time.perf_counter()
        execute(ALIASES_SQL, {"lo": first, "hi": last})
        reset_sequences("adapters_adapter", "adapters_adapterrevision", "adapters_alias")
        self.place()
        timings["aliases_placements_s"] = time.perf_counter() - started
        started = time.perf_counter()
        execute("ANALYZE")
        timings["analyze_s"] = time.perf_counter() - started
        self.adapters = last
        self.revisions = size
        return {k: round(v, 2) for k, v in timings.items()}

    def place(self) -> None:
        """Placements as a steady fleet would hold them: live revisions ready on one or two nodes, some history."""
        execute("DELETE FROM serving_placement")
        live = execute(
            """
            SELECT al.revision_id, a.base_model_id FROM adapters_alias al
            JOIN adapters_adapter a ON a.id = al.adapter_id
            WHERE al.revision_id IS NOT NULL ORDER BY hashint8(al.id * 7919)
            """
        )
        by_base: dict[int, list[str]] = {}
        for name, base, _, _ in NODES:
            by_base.setdefault(self.base_ids[base], []).append(name)
        free = {name: int(slots * 0.9) for name, _, _, slots in NODES}
        placed: set[tuple[int, int]] = set()
        rows = []
        now = _ts(time.time())
        for i, (revision_id, base_id) in enumerate(live):
            nodes = by_base[base_id]
            replicas = 2 if i % 4 == 0 else 1
            for r in range(replicas):
                node = nodes[(i + r) % len(nodes)]
                if free[node] <= 0 or (self.node_ids[node], revision_id) in placed:
                    continue
                free[node] -= 1
                placed.add((self.node_ids[node], revision_id))
                rows.append(_placement(self.node_ids[node], revision_id, "ready", now))
            if not any(free[n] > 0 for n in free):
                break
        # History and queue: failed loads and queued cold requests for revisions not loaded anywhere.
        others = execute(
            "SELECT id FROM adapters_adapterrevision WHERE state = 'approved' ORDER BY hashint8(id) LIMIT 400"
        )
        for j, (revision_id,) in enumerate(others):
            node = NODES[j % len(NODES)][0]
            if (self.node_ids[node], revision_id) in placed:
                continue
            placed.add((self.node_ids[node], revision_id))
            rows.append(_placement(self.node_ids[node], revision_id, "failed" if j % 3 else "queued", now))
        copy_rows("serving_placement", PLACEMENT_COLUMNS, rows)
        reset_sequences("serving_placement")


PLACEMENT_COLUMNS = [
    "node_id",
    "revision_id",
    "state",
    "priority",
    "queued_at",
    "ready_at",
    "last_used_at",
    "load_ms",
    "warm_ms",
    "attempts",
    "failure_reason",
    "updated_at",
]


def _placement(node_id: int, revision_id: int, state: str, now: str) -> tuple:
    ready = state == "ready"
    return (
        node_id,
        revision_id,
        state,
        30 if ready else 20,
        now,
        now if ready else None,
        now if ready else None,
        9.5 if ready else None,
        120.0 if ready else None,
        1 if state != "queued" else 0,
        "vLLM answered 500: rank 64 over --max-lora-rank 16" if state == "failed" else "",
        now,
    )


def _ts(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(epoch))


# u is a stable pseudo-random number in [0, 1000) per (adapter, number): states, ranks and sizes
# are spread without any client-side loop. The latest revision of an adapter is often still in
# flight; older ones are mostly approved or left exported.
REVISIONS_SQL = """
INSERT INTO adapters_adapterrevision (
    adapter_id, number, state, source_uri, export_uri, sha256, size_bytes, rank, alpha, target_modules,
    training_step, policy_record, failure_reason, failure_code, created_at, validated_at, exported_at,
    decided_at, updated_at, created_by_id, created_by_key_id, parent_id)
SELECT adapter_id, n, state,
       format('t/%%s/incoming/run-%%s/step-%%s/', tenant_id, adapter_id, n * 500),
       CASE WHEN state IN ('exported', 'pending_approval', 'approved', 'rejected')
            THEN format('t/%%s/a/%%s/r%%s/export/', tenant_id, adapter_id, n) ELSE '' END,
       md5(adapter_id::text || ':' || n) || md5(n::text || ':' || adapter_id),
       (1 + u %% 64) * 1048576, CASE WHEN u %% 4 = 0 THEN 16 ELSE 8 END, CASE WHEN u %% 4 = 0 THEN 32 ELSE 16 END,
       '["q_proj", "v_proj"]'::jsonb, n * 500,
       CASE WHEN state IN ('exported', 'pending_approval', 'approved', 'rejected') THEN jsonb_build_object(
           'tenant', tenant_id, 'adapter', adapter_id, 'revision', n, 'rank', CASE WHEN u %% 4 = 0 THEN 16 ELSE 8 END,
           'files', jsonb_build_array(
               jsonb_build_object('path', 'adapter_config.json', 'sha256', md5(n::text)),
               jsonb_build_object('path', 'adapter_model.safetensors', 'sha256', md5(adapter_id::text))))
       END,
       CASE WHEN state = 'failed' THEN 'base_model.layers.3.self_attn.q_proj.lora_A.weight has shape [8, 63]; '
                                       || 'expected [8, 64]' ELSE '' END,
       CASE WHEN state = 'failed' THEN 'shape_mismatch' ELSE '' END,
       created, CASE WHEN state <> 'registered' THEN created + interval '2 s' END,
       CASE WHEN state IN ('exported', 'pending_approval', 'approved', 'rejected') THEN created + interval '9 s' END,
       CASE WHEN state IN ('approved', 'rejected') THEN created + interval '1 hour' END,
       created, NULL, NULL, NULL
FROM (
    SELECT a.id AS adapter_id, a.tenant_id, n, u,
           a.created_at + make_interval(secs => n * least(259200.0, 31536000.0 / a.revision_counter)) AS created,
           CASE
               WHEN n = a.revision_counter AND u < 80 THEN 'registered'
               WHEN n = a.revision_counter AND u < 140 THEN 'validated'
               WHEN n = a.revision_counter AND u < 220 THEN 'pending_approval'
               WHEN u < 50 THEN 'failed'
               WHEN u < 90 THEN 'rejected'
               WHEN u < 400 AND n > 1 THEN 'exported'
               ELSE 'approved'
           END AS state
    FROM adapters_adapter a
    CROSS JOIN LATERAL generate_series(1, a.revision_counter) AS n
    CROSS JOIN LATERAL (SELECT (hashint8(a.id * 1000003 + n) %% 1000 + 1000) %% 1000 AS u) h
    WHERE a.id BETWEEN %(lo)s AND %(hi)s
) g
ORDER BY created
"""

# production → the newest approved revision; for every fifth adapter with two approved revisions,
# production lags on the one before and `candidate` holds the newest; every 50th has an activation
# in flight (desired ≠ live).
ALIASES_SQL = """
WITH approved AS (
    SELECT adapter_id, id, row_number() OVER (PARTITION BY adapter_id ORDER BY number DESC) AS rn
    FROM adapters_adapterrevision
    WHERE adapter_id BETWEEN %(lo)s AND %(hi)s AND state = 'approved'
), top2 AS (
    SELECT adapter_id, max(id) FILTER (WHERE rn = 1) AS newest, max(id) FILTER (WHERE rn = 2) AS before
    FROM approved WHERE rn <= 2 GROUP BY adapter_id
)
INSERT INTO adapters_alias (name, rollback_pending, updated_by, updated_at, adapter_id, revision_id,
                            desired_revision_id, previous_revision_id)
SELECT 'production', false, 'key:bench', now(), adapter_id,
       CASE WHEN adapter_id %% 5 = 0 AND before IS NOT NULL THEN before ELSE newest END,
       CASE WHEN adapter_id %% 50 = 1 AND before IS NOT NULL THEN newest
            WHEN adapter_id %% 5 = 0 AND before IS NOT NULL THEN before ELSE newest END,
       before
FROM top2
UNION ALL
SELECT 'candidate', false, 'key:bench', now(), adapter_id, newest, newest, NULL
FROM top2 WHERE adapter_id %% 5 = 0 AND before IS NOT NULL
"""


# ---------------------------------------------------------------------------------------------
# Measuring


def probes(limit: int, rng: np.random.Generator) -> list[tuple[int, str]]:
    """(tenant id, model string) pairs that resolve to a revision with a ready placement on an up node."""
    rows = execute(
        """
        SELECT DISTINCT ON (r.id) a.tenant_id, a.name, al.name, r.number, al.revision_id = r.id
        FROM serving_placement p
        JOIN serving_servingnode n ON n.id = p.node_id AND n.state = 'up'
        JOIN adapters_adapterrevision r ON r.id = p.revision_id
        JOIN adapters_adapter a ON a.id = r.adapter_id
        JOIN adapters_alias al ON al.adapter_id = a.id AND al.revision_id = r.id
        WHERE p.state = 'ready'
        ORDER BY r.id
        """
    )
    out = []
    for i, (tenant_id, adapter, alias, number, _) in enumerate(rows):
        form = i % 6
        if form == 0:
            out.append((tenant_id, f"{adapter}@r{number}"))
        elif alias != "production":
            out.append((tenant_id, f"{adapter}:{alias}"))
        else:
            out.append((tenant_id, adapter))
    order = rng.permutation(len(out))[:limit]
    return [out[i] for i in order]


async def measure_resolution(refs: list, raw: dict[str, list[float]], *, cold_n: int, cached_n: int) -> None:
    """Cold resolutions (caches cleared before each), then cached ones; appends seconds to `raw`."""
    from serving.gateway import resolve as gateway

    for tenant_id, ref, model in refs[:20]:  # warm the thread, its connection and the plan cache
        gateway.clear()
        await gateway.resolve(tenant_id, ref, model)
    offset = len(raw["cold"])
    for i in range(cold_n):
        tenant_id, ref, model = refs[(offset + i) % len(refs)]
        gateway.clear()
        started = time.perf_counter()
        found = await gateway.resolve(tenant_id, ref, model)
        raw["cold"].append(time.perf_counter() - started)
        if not found.targets:
            raise RuntimeError(f"{model} of tenant {tenant_id} resolved to no ready placement")
    gateway.clear()
    for tenant_id, ref, model in refs:
        await gateway.resolve(tenant_id, ref, model)
    for i in range(cached_n):
        tenant_id, ref, model = refs[i % len(refs)]
        started = time.perf_counter()
        await gateway.resolve(tenant_id, ref, model)
        raw["cached"].append(time.perf_counter() - started)


def measure_resolution_queries(refs: list, raw: list[float], n: int) -> None:
    """The database part of a cold resolution alone: `_resolve_sync` called in this thread, no thread hop."""
    from serving.gateway import resolve as gateway

    for i in range(n):
        tenant_id, ref, _ = refs[i % len(refs)]
        started = time.perf_counter()
        gateway._resolve_sync(tenant_id, ref)
        raw.append(time.perf_counter() - started)


class Api:
    """In-process DRF calls with a pipeline key of one tenant."""

    def __init__(self, tenant_id: int) -> None:
        from rest_framework.test import APIClient

        from tenants import services
        from tenants.access import Actor
        from tenants.models import Tenant

        tenant = Tenant.objects.get(id=tenant_id)
        _, token = services.api_key_create(
            tenant=tenant, name="catalog-bench", scopes=["pipeline"], created_by=None, by=Actor.system()
        )
        self.tenant = tenant
        self.client = APIClient()
        self.client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")

    def get(self, url: str, **params) -> tuple[float, dict]:
        started = time.perf_counter()
        response = self.client.get(url, params)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"GET {url}: {response.status_code} {response.content[:300]!r}")
        return elapsed, response.json()

    def post(self, url: str, body: dict) -> float:
        started = time.perf_counter()
        response = self.client.post(url, body, format="json")
        elapsed = time.perf_counter() - started
        if response.status_code != 201:
            raise RuntimeError(f"POST {url}: {response.status_code} {response.content[:300]!r}")
        return elapsed


def list_targets() -> dict:
    """Who the list pages are measured on: (tenant id, adapter name, revisions) of the longest run, of an
    old long run, of a median adapter; and the biggest tenant."""
    longest = execute(
        "SELECT tenant_id, name, revision_counter FROM adapters_adapter ORDER BY revision_counter DESC, id LIMIT 1"
    )[0]
    # A long run that finished long ago: many revisions, all far from the newest end of the table.
    # Paging it by `-id` without an (adapter, -id) index walks the primary key through every newer row.
    oldest_run = execute(
        "SELECT tenant_id, name, revision_counter FROM adapters_adapter "
        "WHERE revision_counter >= (SELECT max(revision_counter) / 10 FROM adapters_adapter) ORDER BY id LIMIT 1"
    )
    median = execute(
        """
        SELECT tenant_id, name, revision_counter FROM adapters_adapter
        WHERE revision_counter = (SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY revision_counter)
                                  FROM adapters_adapter)
        ORDER BY id LIMIT 1
        """
    )[0]
    biggest = execute("SELECT tenant_id, count(*) FROM adapters_adapter GROUP BY tenant_id ORDER BY 2 DESC LIMIT 1")[0]
    # Registration goes to adapters no list page reads, so new rows do not change what the pages show.
    register = execute(
        """
        (SELECT tenant_id, name, revision_counter FROM adapters_adapter
         ORDER BY revision_counter DESC, id OFFSET 1 LIMIT 1)
        UNION ALL
        (SELECT tenant_id, name, revision_counter FROM adapters_adapter WHERE revision_counter BETWEEN 2 AND 10
         ORDER BY id DESC LIMIT 1)
        """
    )
    return {
        "longest": longest,
        "oldest_run": (oldest_run or [longest])[0],
        "median": median,
        "biggest_tenant": biggest,
        "register": register,
    }


IN_FLIGHT = "registered,validated,pending_approval"


def list_cases(targets: dict) -> list[tuple[str, int, str, dict]]:
    """(name, tenant id, url, query) of each list page measured."""
    longest_tenant, longest, _ = targets["longest"]
    old_tenant, old, _ = targets["oldest_run"]
    median_tenant, median, _ = targets["median"]
    revisions = f"/api/v1/adapters/{longest}/revisions/"
    return [
        ("revisions_first_page", longest_tenant, revisions, {}),
        ("revisions_state_approved", longest_tenant, revisions, {"state": "approved"}),
        ("revisions_state_failed", longest_tenant, revisions, {"state": "failed"}),
        ("revisions_state_in_flight", longest_tenant, revisions, {"state": IN_FLIGHT}),
        ("revisions_oldest_run", old_tenant, f"/api/v1/adapters/{old}/revisions/", {}),
        ("revisions_median_adapter", median_tenant, f"/api/v1/adapters/{median}/revisions/", {}),
        ("adapters_biggest_tenant", targets["biggest_tenant"][0], "/api/v1/adapters/", {}),
    ]


def measure_lists(state: SizeState, n: int) -> None:
    for name, tenant_id, url, params in list_cases(state.targets):
        api = state.apis[tenant_id]
        api.get(url, **params)
        state.raw.setdefault(name, []).extend(api.get(url, **params)[0] for _ in range(n))
    # Walk the longest run's cursor, on from where the last round stopped: a deep page must cost
    # what the first one does.
    longest_tenant, longest, _ = state.targets["longest"]
    walk = state.raw.setdefault("revisions_cursor_walk", [])
    for _ in range(n):
        elapsed, page = state.apis[longest_tenant].get(state.cursor or f"/api/v1/adapters/{longest}/revisions/")
        walk.append(elapsed)
        state.cursor = page.get("next")


def measure_registration(state: SizeState, n: int, artifacts: Path) -> None:
    """Register `n` revisions from a source_uri, alternately on a long run and on a small adapter."""
    cases = state.targets["register"]
    for tenant_id, _, _ in cases:
        incoming = artifacts / f"t/{tenant_id}/incoming/run"
        if not incoming.exists():
            incoming.mkdir(parents=True)
            (incoming / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
            (incoming / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    timings = state.raw.setdefault("registration", [])
    for i in range(n + 2):
        tenant_id, name, _ = cases[i % 2]
        elapsed = state.apis[tenant_id].post(
            f"/api/v1/adapters/{name}/revisions/", {"source_uri": f"t/{tenant_id}/incoming/run/", "training_step": i}
        )
        if i >= 2:  # the first two warm the paths
            timings.append(elapsed)
    flush_redis()


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
        plans.append(_plan_summary(label, sql, plan[0] if isinstance(plan, list) else plan))
    return plans


def _plan_summary(label: str, sql: str, plan: dict) -> dict:
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
        WHERE c.relname IN ('tenants_tenant', 'adapters_adapter', 'adapters_adapterrevision', 'adapters_alias',
                            'serving_placement')
        """
    )
    return {name: {"rows": int(rows_), "bytes": int(size)} for name, rows_, size in rows}


@dataclass
class SizeState:
    """One catalog size under measurement: its database, who to ask, and the raw timings (seconds) so far."""

    size: int
    database: str
    load: dict
    targets: dict = field(default_factory=dict)
    apis: dict = field(default_factory=dict)
    refs: list = field(default_factory=list)
    cursor: str | None = None
    raw: dict[str, list[float]] = field(default_factory=dict)
    loadavg: list[float] = field(default_factory=list)


def clone_database(source: str, target: str) -> None:
    """A file-level copy of the catalog as it is now (statistics included), for measuring this size later."""
    import psycopg

    disconnect()  # CREATE DATABASE … TEMPLATE needs the source to have no session
    admin = urlunsplit(urlsplit(bench_database_url(DB_NAME))._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{target}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{target}" TEMPLATE "{source}"')


def drop_database(name: str) -> None:
    import psycopg

    admin = urlunsplit(urlsplit(bench_database_url(DB_NAME))._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def disconnect() -> None:
    """Close this thread's connection, the gateway's sync_to_async thread's, and the pool behind both."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    connections.close_all()
    asyncio.run(sync_to_async(connections.close_all)())
    close_pool = getattr(connections["default"], "close_pool", None)
    if close_pool is not None:  # settings use a psycopg pool unless DATABASE_URL says ?pool=0
        close_pool()


def use_database(name: str) -> None:
    """Point every connection at another database (the settings dict is shared by every thread's wrapper)."""
    from django.db import connections

    disconnect()
    connections["default"].settings_dict["NAME"] = name


def prepare(state: SizeState, rng: np.random.Generator) -> None:
    from serving.gateway import resolve as gateway

    state.targets = list_targets()
    tenants = {tenant_id for _, tenant_id, _, _ in list_cases(state.targets)}
    state.apis = {tenant_id: Api(tenant_id) for tenant_id in tenants | {t for t, _, _ in state.targets["register"]}}
    state.refs = [(t, gateway.parse_model(m), m) for t, m in probes(1000, rng)]
    for key in ("cold", "cached", "queries_only"):
        state.raw[key] = []


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
    global DB_NAME  # --database names the benchmark's databases for every helper
    p = parser(__doc__)
    p.add_argument("--sizes", help="comma-separated catalog sizes (revisions), e.g. 1000,10000")
    p.add_argument("--keep", action="store_true", help="keep the per-size databases for inspection")
    p.add_argument("--database", default=DB_NAME, help=f"the benchmark's database name (default {DB_NAME})")
    args = p.parse_args()
    DB_NAME = args.database
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    # Per size, over all rounds. The rounds visit every size in turn, so load from other work on
    # the machine falls on every size alike rather than on whichever was measured at the time.
    rounds, cold_n, cached_n, list_n, register_n = (2, 100, 1000, 10, 6) if args.quick else (5, 3000, 20000, 200, 100)
    server_n = 50 if args.quick else 1000
    work = Path(tempfile.mkdtemp(prefix="mint-bench-catalog-"))
    total_started = time.perf_counter()
    states: list[SizeState] = []
    try:
        setup_django(work)
        catalog = Catalog()
        catalog.create_fixed()
        for size in sizes:
            print(f"catalog: growing to {size} revisions", file=sys.stderr, flush=True)
            started = time.perf_counter()
            load = catalog.grow(size)
            load["total_s"] = round(time.perf_counter() - started, 2)
            database = DB_NAME if size == sizes[-1] else f"{DB_NAME}_{size}"
            if database != DB_NAME:
                clone_database(DB_NAME, database)
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
    finally:
        if states:
            disconnect()
        if not args.keep:
            for state in states:
                if state.database != DB_NAME:
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
    try:
        from benchmarks import report

        report.plot(path)
    except ImportError as exc:  # matplotlib is a dev extra
        print(f"catalog: no plot ({exc})", file=sys.stderr)
    print(json.dumps({k: v for k, v in figures.items() if k != "results"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
