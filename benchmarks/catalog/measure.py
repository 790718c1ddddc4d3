"""The timed paths at one catalog size: model resolution (cold, cached, queries only), the REST list pages and
registration from a `source_uri`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.catalog.db import execute
from benchmarks.common import flush_redis


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


def probes(limit: int, rng: np.random.Generator) -> list[tuple[int, str]]:
    """(tenant id, model string) pairs that resolve to a revision with a ready placement on an up node."""
    rows = execute(
        """
        SELECT DISTINCT ON (r.id) a.tenant_id, a.name, al.name, r.number, al.revision_id = r.id
        FROM serving_placement p
        JOIN serving_servingnode n ON n.id = p.node_id AND n.state = 'up'
        JOIN adapters_adapterrevision r ON r.id = p.revision_id
        JOIN adapters_adapter a ON a.id = r.adapter_id
        JOIN serving_alias al ON al.adapter_id = a.id AND al.revision_id = r.id
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
    from serving.gateway.state import GatewayState

    state = GatewayState.build()  # a gateway process's state, as its lifespan builds it

    def forget() -> None:
        state.routes.clear()
        state.prewarmed.clear()

    try:
        for tenant_id, ref, model in refs[:20]:  # warm the threads, their connections and the plan cache
            forget()
            await gateway.resolve(state, tenant_id, ref, model)
        offset = len(raw["cold"])
        for i in range(cold_n):
            tenant_id, ref, model = refs[(offset + i) % len(refs)]
            forget()
            started = time.perf_counter()
            found = await gateway.resolve(state, tenant_id, ref, model)
            raw["cold"].append(time.perf_counter() - started)
            if not found.targets:
                raise RuntimeError(f"{model} of tenant {tenant_id} resolved to no ready placement")
        forget()
        for tenant_id, ref, model in refs:
            await gateway.resolve(state, tenant_id, ref, model)
        for i in range(cached_n):
            tenant_id, ref, model = refs[i % len(refs)]
            started = time.perf_counter()
            await gateway.resolve(state, tenant_id, ref, model)
            raw["cached"].append(time.perf_counter() - started)
    finally:
        await state.shutdown()


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


def prepare(state: SizeState, rng: np.random.Generator) -> None:
    from serving.gateway import resolve as gateway

    state.targets = list_targets()
    tenants = {tenant_id for _, tenant_id, _, _ in list_cases(state.targets)}
    state.apis = {tenant_id: Api(tenant_id) for tenant_id in tenants | {t for t, _, _ in state.targets["register"]}}
    state.refs = [(t, gateway.parse_model(m), m) for t, m in probes(1000, rng)]
    for key in ("cold", "cached", "queries_only"):
        state.raw[key] = []
