"""One tenant with 10^5 adapters (a platform with an adapter per customer of its own), added to the largest
catalog: its adapter list and search through the REST API (`GET /api/v1/adapters/`, a pipeline key) and the
dashboard's overview (`GET /`, a signed-in viewer), each request handled by Django in this process. Per request it
keeps the wall time (the server's time for it, on a machine other work shares) and this process's CPU time (what
the request costs here, less the time spent waiting for the database or for a core).

The tenant's adapters are named like the rest of the catalog (`<word>-<id>`) with nine of its ten words (the tenth,
`extract`, is only other tenants'), one to six revisions each, `production` on most, an activation in flight on
one in fifty, the newest revision awaiting a decision on about one in twelve.
"""

from __future__ import annotations

import html
import os
import re
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import numpy as np

from benchmarks.catalog import WORDS
from benchmarks.catalog.db import execute, reset_sequences
from benchmarks.catalog.load import ALIASES_SQL, REVISIONS_SQL, UNTHROTTLED, Catalog, copy_adapters
from benchmarks.catalog.measure import Api
from benchmarks.common import summary_ms

ADAPTERS = 100_000
QUICK_ADAPTERS = 2_000
OWN_WORDS = WORDS[:-1]  # the big tenant's names never hold the last word, which other tenants' do
# The figures catalog.json carries at its top level: each the p95 of the worst case of its kind.
KEYS = ["adapter_list_p95_ms", "adapter_search_p95_ms", "dashboard_list_p95_ms", "dashboard_search_p95_ms"]
EMPTY = {"none", "none_short", "elsewhere"}  # searches that find nothing in the big tenant
NEXT_LINK = re.compile(r'href="\?([^"]*)" rel="next"')
DASHBOARD_STATES = ["flipping", "awaiting", "inactive", "serving"]


def searches(first_id: int, count: int) -> dict[str, str]:
    """What people type, from the commonest match to none (label → q). Three characters or more match anywhere in
    the name, one or two its start (adapters.selectors.adapter_search)."""
    one = first_id + count // 3
    word = OWN_WORDS[one % len(OWN_WORDS)]
    return {
        "word": "support",  # a ninth of the names, anywhere in the list
        "prefix": f"{word}-{str(one)[:3]}",  # a word and the start of a number: hundreds
        "digits": str(one)[-4:],  # four digits anywhere in the name: tens
        "one_name": f"{word}-{one}",  # one adapter by its whole name
        "one_char": "s",  # names starting with it: four words of nine
        "two_chars": "tr",  # two: triage, translate
        "none": "nomatch",  # nothing
        "none_short": "zq",  # nothing, two characters
        "elsewhere": WORDS[-1],  # nothing here, a tenth of every other tenant's names
    }


@dataclass
class BigTenant:
    """The tenant under measurement, its callers, and the raw timings (seconds) per case."""

    tenant_id: int
    adapters: int
    first_id: int
    api: Api
    page: object  # django.test.Client, signed in as the tenant's viewer
    load: dict
    api_cursor: str | None = None
    page_next: dict | None = None
    raw: dict[str, list[float]] = field(default_factory=dict)
    raw_cpu: dict[str, list[float]] = field(default_factory=dict)
    loadavg: list[float] = field(default_factory=list)  # the machine's 1-minute load average around each round

    @property
    def searches(self) -> dict[str, str]:
        return searches(self.first_id, self.adapters)


def load_big_tenant(catalog: Catalog, adapters: int) -> BigTenant:
    """Add the tenant, its adapters, their revisions and aliases to the catalog, as the catalog grows (COPY, then
    INSERT … SELECT in the server)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    from tenants.models import Membership, Tenant

    timings: dict[str, float] = {}
    started = time.perf_counter()
    read_rpm, write_rpm, max_revisions = UNTHROTTLED
    tenant = Tenant.objects.create(
        slug="saas-platform",
        name="SaaS platform",
        max_adapters=10 * adapters,
        api_read_rpm=read_rpm,
        api_write_rpm=write_rpm,
        max_revisions=max_revisions,
    )
    first = int(execute("SELECT COALESCE(max(id), 0) + 1 FROM adapters_adapter")[0][0])
    rng = np.random.default_rng(catalog.rng.integers(1 << 31))
    counts = np.minimum(rng.geometric(0.45, size=adapters), 6)
    bases = np.where(rng.random(adapters) < 0.15, catalog.base_ids[1], catalog.base_ids[0])
    base_time = time.time() - 200 * 86400
    starts = np.sort(rng.uniform(0, 180 * 86400, size=adapters))  # ids grow with creation, as they do

    def rows():
        for i in range(adapters):
            adapter_id = first + i
            created = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(base_time + starts[i]))
            name = f"{OWN_WORDS[adapter_id % len(OWN_WORDS)]}-{adapter_id}"
            yield (adapter_id, name, created, int(counts[i]), tenant.id, int(bases[i]))

    copy_adapters(rows())
    last = first + adapters - 1
    timings["adapters_s"] = time.perf_counter() - started
    started = time.perf_counter()
    execute(REVISIONS_SQL, {"lo": first, "hi": last})
    execute(ALIASES_SQL, {"lo": first, "hi": last})
    # One in fifty waits for an activation: production still serves the approved revision before the newest.
    execute(
        "UPDATE serving_alias SET revision_id = previous_revision_id WHERE adapter_id BETWEEN %(lo)s AND %(hi)s "
        "AND adapter_id %% 50 = 1 AND name = 'production' AND previous_revision_id IS NOT NULL",
        {"lo": first, "hi": last},
    )
    reset_sequences("adapters_adapter", "adapters_adapterrevision", "serving_alias")
    catalog.adapters = last
    timings["revisions_aliases_s"] = time.perf_counter() - started
    started = time.perf_counter()
    execute("ANALYZE")
    timings["analyze_s"] = time.perf_counter() - started

    user = get_user_model().objects.create_user(username="saas-viewer", password=None)
    Membership.objects.create(user=user, tenant=tenant, role="viewer")
    page = Client()
    page.force_login(user)
    state = BigTenant(
        tenant_id=tenant.id,
        adapters=adapters,
        first_id=first,
        api=Api(tenant.id),
        page=page,
        load={k: round(v, 2) for k, v in timings.items()},
    )
    for label, q in state.searches.items():  # each search finds what its label says
        _, body = state.api.get("/api/v1/adapters/", q=q)
        if (label in EMPTY) == bool(body["results"]):
            raise RuntimeError(f"search {label} ({q!r}) found {len(body['results'])} adapters")
    return state


def _page(state: BigTenant, params: dict | None = None) -> tuple[float, bytes]:
    started = time.perf_counter()
    response = state.page.get("/", params or {})
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"GET / {params}: {response.status_code} {response.content[:300]!r}")
    return elapsed, response.content


def cases(state: BigTenant) -> list[tuple[str, object]]:
    """(name, call) of every measured request; each call returns its wall time in seconds."""

    def api(params: dict):
        return lambda: state.api.get("/api/v1/adapters/", **params)[0]

    def page(params: dict):
        return lambda: _page(state, params)[0]

    def api_walk() -> float:
        # Deeper pages, on from where the last call stopped: a deep page costs what the first does.
        elapsed, body = state.api.get(state.api_cursor or "/api/v1/adapters/")
        state.api_cursor = body.get("next")
        return elapsed

    def page_walk() -> float:
        # The same on the dashboard, following the page's own "Next" link.
        elapsed, content = _page(state, state.page_next)
        link = NEXT_LINK.search(content.decode())
        state.page_next = dict(parse_qsl(html.unescape(link.group(1)))) if link else None
        return elapsed

    found = [("adapters_list_first_page", api({})), ("adapters_list_cursor_walk", api_walk)]
    found += [(f"adapters_search_{label}", api({"q": q})) for label, q in state.searches.items()]
    found += [("dashboard_list_first_page", page({})), ("dashboard_list_walk", page_walk)]
    found += [(f"dashboard_search_{label}", page({"q": q})) for label, q in state.searches.items()]
    found += [(f"dashboard_state_{s}", page({"state": s})) for s in DASHBOARD_STATES]
    return found


def measure_big_tenant(state: BigTenant, n: int, *, warm: bool) -> None:
    """One round: every case `n` times (after one call that warms it, in the first round), wall and CPU times kept."""
    state.loadavg.append(round(os.getloadavg()[0], 2))
    for name, call in cases(state):
        if warm:
            call()
        for _ in range(n):
            cpu = time.process_time()
            state.raw.setdefault(name, []).append(call())
            state.raw_cpu.setdefault(name, []).append(time.process_time() - cpu)
    state.loadavg.append(round(os.getloadavg()[0], 2))


def summarize(state: BigTenant) -> dict:
    cases_ms = {}
    for name, walls in state.raw.items():
        cpu = summary_ms(state.raw_cpu[name])
        cases_ms[name] = summary_ms(walls) | {"cpu_p50_ms": cpu["p50_ms"], "cpu_p95_ms": cpu["p95_ms"]}

    def worst(prefix: str, key: str = "p95_ms") -> float:
        return max(v[key] for k, v in cases_ms.items() if k.startswith(prefix))

    return {
        "adapters": state.adapters,
        "load": state.load,
        "loadavg_1m": {"min": min(state.loadavg), "max": max(state.loadavg)} if state.loadavg else None,
        "searches": state.searches,
        "cases": cases_ms,
        "adapter_list_p95_ms": worst("adapters_list_"),
        "adapter_search_p95_ms": worst("adapters_search_"),
        "dashboard_list_p95_ms": worst("dashboard_list_"),
        "dashboard_search_p95_ms": worst("dashboard_search_"),
        "dashboard_state_p95_ms": worst("dashboard_state_"),
        "cpu_p95_ms": {
            kind: worst(f"{kind}_", "cpu_p95_ms")
            for kind in ("adapters_list", "adapters_search", "dashboard_list", "dashboard_search", "dashboard_state")
        },
    }
