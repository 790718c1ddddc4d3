"""Generating the catalog: tenants, base models and nodes, then adapters, revisions, aliases and placements
grown in place (COPY and server-side INSERT … SELECT)."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.catalog import NODES, SEED, TENANTS, WORDS
from benchmarks.catalog.db import copy_rows, execute, reset_sequences

UNTHROTTLED = (1_000_000, 1_000_000, 100_000_000)  # api_read_rpm, api_write_rpm, max_revisions


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
                # The measured callers read and register far faster than a plan allows; throttles are not measured.
                "api_read_rpm",
                "api_write_rpm",
                "max_revisions",
            ],
            (
                (f"tenant-{i:05d}", f"Tenant {i}", i % 500 != 7, 100_000, 64, 600, 512 * 2**20, True, now, *UNTHROTTLED)
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
                yield (adapter_id, name, created, k, int(tenants[i]), int(bases[i]))

        copy_adapters(adapter_rows())
        last = first + len(counts) - 1
        timings["adapters_s"] = time.perf_counter() - started

        # Revisions are generated in the server, interleaved in time across adapters as real
        # registrations are (an adapter's revisions end up scattered over the heap).
        started = time.perf_counter()
        execute(REVISIONS_SQL, {"lo": first, "hi": last})
        timings["revisions_s"] = time.perf_counter() - started
        started = time.perf_counter()
        execute(ALIASES_SQL, {"lo": first, "hi": last})
        reset_sequences("adapters_adapter", "adapters_adapterrevision", "serving_alias")
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
            SELECT al.revision_id, a.base_model_id FROM serving_alias al
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


def copy_adapters(rows) -> int:
    """COPY adapters given as (id, name, created_at, revision_counter, tenant_id, base_model_id); no description,
    no tags."""
    return copy_rows(
        "adapters_adapter",
        ["id", "name", "created_at", "revision_counter", "tenant_id", "base_model_id", "description", "tags"],
        ((*row, "", "[]") for row in rows),
    )


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
    "load_source",
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
        "",
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
    decided_at, updated_at, created_by_id, created_by_key_id, parent_id, metrics)
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
       created, NULL, NULL, NULL, '{}'::jsonb
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
INSERT INTO serving_alias (name, rollback_pending, updated_by, updated_at, adapter_id, revision_id,
                            desired_revision_id, previous_revision_id, canary_by)
SELECT 'production', false, 'key:bench', now(), adapter_id,
       CASE WHEN adapter_id %% 5 = 0 AND before IS NOT NULL THEN before ELSE newest END,
       CASE WHEN adapter_id %% 50 = 1 AND before IS NOT NULL THEN newest
            WHEN adapter_id %% 5 = 0 AND before IS NOT NULL THEN before ELSE newest END,
       before, ''
FROM top2
UNION ALL
SELECT 'candidate', false, 'key:bench', now(), adapter_id, newest, newest, NULL, ''
FROM top2 WHERE adapter_id %% 5 = 0 AND before IS NOT NULL
"""
