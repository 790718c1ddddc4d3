"""Figures and a written summary of every benchmark's results.

(a) One PNG per results file: benchmarks/results/<name>.png.
(b) docs/benchmarks.md: each benchmark's figures against its target and the MinT paper.

Results are read defensively: a benchmark that has not run yet is "not run yet", a key that
is missing reads as "—", and a results file of a shape this module does not know still gets a
generic table (and plot) of its numbers.

    python -m benchmarks.report [--out DIR] [--docs PATH]
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BASE_DIR, RESULTS, parser

# The order of `make bench` and of the report.
BENCHMARKS = ["registration", "gateway_overhead", "readiness_isolation", "live_events", "packing", "catalog"]
DOCS = BASE_DIR / "docs" / "benchmarks.md"

# The MinT paper's figures we compare against.
PAPER = {
    "register_s": 1.66,
    "moe_tensors_before": 37_248,
    "moe_tensors_after": 672,
    "moe_shape": "Qwen3-30B-A3B, 48 layers x 128 experts, rank 1",
    "read_s_before": 0.3669,
    "read_s_after": 0.0067,
    "read_speedup": 54.8,
    "live_load_s_before": 1.36,
    "live_load_s_after": 0.16,
    "live_load_speedup": "8.5-8.7",
}

MISSING = "—"


# ---------------------------------------------------------------------------------------------
# Reading results


def load(name: str, results: Path) -> dict | None:
    path = results / f"{name}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return {"benchmark": name, "_error": f"unreadable: {exc}"}


def get(data: Any, *paths: str, default: Any = None) -> Any:
    """The first of several dotted paths present in `data` (`a.b.0.c`), else `default`."""
    for path in paths:
        node = data
        for part in path.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
                node = node[int(part)]
            else:
                break
        else:
            return node
    return default


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    v = number(value)
    if v is None:
        return MISSING if value is None else str(value)
    if abs(v) >= 1000 or digits == 0 or isinstance(value, int):
        text = f"{v:,.0f}"
    elif abs(v) >= 100:
        text = f"{v:.1f}"
    else:
        text = f"{v:.{digits}f}"
    return f"{text}{unit}"


def leaves(data: Any, prefix: str = "", skip: Iterable[str] = ("machine", "plans")) -> Iterable[tuple[str, Any]]:
    """Every scalar leaf of a JSON document as (dotted path, value), skipping bulky branches."""
    if isinstance(data, dict):
        for key in sorted(data):
            if key in skip:
                continue
            yield from leaves(data[key], f"{prefix}{key}.", skip)
    elif isinstance(data, list):
        if data and all(not isinstance(x, dict | list) for x in data) and len(data) <= 8:
            yield prefix.rstrip("."), ", ".join(str(x) for x in data)
            return
        for i, item in enumerate(data[:8]):
            yield from leaves(item, f"{prefix}{i}.", skip)
    else:
        yield prefix.rstrip("."), data


def summaries(data: Any, prefix: str = "") -> Iterable[tuple[str, dict]]:
    """Every latency summary (a dict with p50_ms) in a document, as (dotted path, summary)."""
    if isinstance(data, dict):
        if "p50_ms" in data:
            yield prefix.rstrip(".") or "latency", data
            return
        for key in sorted(data):
            if key not in ("machine", "plans"):
                yield from summaries(data[key], f"{prefix}{key}.")
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from summaries(item, f"{prefix}{i}.")


# ---------------------------------------------------------------------------------------------
# Verdicts: each benchmark's headline figures against its target


@dataclass
class Row:
    figure: str
    measured: Any
    target: str
    ok: bool | None  # None: cannot tell (missing figure)
    paper: str = ""
    unit: str = ""

    def cells(self) -> list[str]:
        verdict = MISSING if self.ok is None else ("met" if self.ok else "**missed**")
        return [self.figure, fmt(self.measured, self.unit), self.target, verdict, self.paper]


def check(value: Any, op: str, limit: float) -> bool | None:
    v = number(value)
    if v is None:
        return None
    return {"<": v < limit, "<=": v <= limit, ">=": v >= limit}[op]


def rows_registration(d: dict) -> list[Row]:
    p95 = get(d, "source_uri.clients_1.p95_ms")
    return [
        Row("source_uri, 1 client: p95", p95, "< 50 ms", check(p95, "<", 50), "1.66 s to register", " ms"),
        Row("source_uri, 1 client: p50", get(d, "source_uri.clients_1.p50_ms"), "", None, unit=" ms"),
        Row("source_uri, 16 clients: p95", get(d, "source_uri.clients_16.p95_ms"), "", None, unit=" ms"),
        Row("10 MB upload, 1 client: p95", get(d, "upload_10mb.clients_1.p95_ms"), "", None, unit=" ms"),
        Row("10 MB upload, 16 clients: p95", get(d, "upload_10mb.clients_16.p95_ms"), "", None, unit=" ms"),
    ]


def rows_gateway_overhead(d: dict) -> list[Row]:
    ratio, diff = get(d, "p50_ratio"), get(d, "p99_difference_ms")
    return [
        Row("p50 gateway ÷ direct", ratio, "≤ 1.05", check(ratio, "<=", 1.05)),
        Row("p99 gateway - direct", diff, "≤ 3 ms", check(diff, "<=", 3.0), unit=" ms"),
        Row("direct p50 / p99", f"{fmt(get(d, 'direct.p50_ms'))} / {fmt(get(d, 'direct.p99_ms'))} ms", "", None),
        Row("gateway p50 / p99", f"{fmt(get(d, 'gateway.p50_ms'))} / {fmt(get(d, 'gateway.p99_ms'))} ms", "", None),
    ]


def rows_readiness_isolation(d: dict) -> list[Row]:
    ratio = get(d, "steady_p95_ratio")
    first = get(d, "first_over_warm.median", "first_over_warm")
    return [
        Row("steady p95 during ÷ before activations", ratio, "≤ 1.05", check(ratio, "<=", 1.05)),
        Row("new adapter first ÷ warm request (median)", first, "≤ 1.1", check(first, "<=", 1.1)),
        Row("new adapter first ÷ warm request (p95 / max)", get(d, "first_over_warm.p95"), "", None),
        Row(
            "activations / window",
            f"{fmt(get(d, 'activated'), digits=0)} in {fmt(get(d, 'activation_window_s'))} s",
            "",
            None,
        ),
        Row("steady errors", fmt(get(d, "steady_errors"), digits=0), "0", check(get(d, "steady_errors"), "<=", 0)),
    ]


def rows_live_events(d: dict) -> list[Row]:
    target = number(get(d, "target_p95_ms", "target.p95_ms")) or 250.0
    rows = [
        Row(f"{path}: p95", s.get("p95_ms"), f"≤ {fmt(target)} ms", check(s.get("p95_ms"), "<=", target), unit=" ms")
        for path, s in summaries(d)
    ]
    return rows or [Row("p95", get(d, "p95_ms"), f"≤ {fmt(target)} ms", check(get(d, "p95_ms"), "<=", target))]


def rows_packing(d: dict) -> list[Row]:
    """benchmarks/packing.py's keys first, then a few other likely names; everything shows in the table below."""
    read = get(d, "read.packed.speedup_vs_per_expert", "read_speedup", "speedup.read")
    read_many = get(d, "read.many_file.p50_ms")
    read_before, read_after = get(d, "read.per_expert.p50_ms"), get(d, "read.packed.p50_ms")
    same = get(d, "live_load_summary.speedup_same_node", "live_load_speedup", "speedup.live_load")
    generic = get(d, "live_load_summary.speedup_vs_generic_per_expert")
    load_before = get(d, "live_load_summary.per_expert_generic_ms")
    load_after = get(d, "live_load_summary.packed_sized_ms")
    before = get(d, "tensors.per_expert", "tensors_before", "tensors.before")
    after = get(d, "tensors.packed", "tensors_after", "tensors.after")
    x = "x"
    return [
        Row("tensors before → after", f"{fmt(before, digits=0)} → {fmt(after, digits=0)}", "", None, "37,248 → 672"),
        Row(
            "tensor read speed-up (per-expert file → packed)",
            read,
            "≥ 55x",
            check(read, ">=", 55),
            "54.8x (0.3669 s → 0.0067 s)",
            x,
        ),
        Row(
            "tensor read p50: per-expert → packed (one file per tensor)",
            f"{fmt(read_before, ' ms')} → {fmt(read_after, ' ms')} ({fmt(read_many, ' ms')})",
            "",
            None,
        ),
        Row("live vLLM load speed-up, same node", same, "≥ 10x", check(same, ">=", 10), "8.5-8.7x", x),
        Row(
            "live vLLM load speed-up, vs per-expert on a generic node",
            generic,
            "≥ 10x",
            check(generic, ">=", 10),
            "1.36 s → 0.16 s",
            x,
        ),
        Row("live load p50: per-expert → packed", f"{fmt(load_before, ' ms')} → {fmt(load_after, ' ms')}", "", None),
    ]


def rows_catalog(d: dict) -> list[Row]:
    sizes = get(d, "ratio_sizes", default=[None, None])
    ratio = get(d, "resolution_cold_p99_ratio")
    cached = get(d, "resolution_cached_p99_ms")
    lists = get(d, "list_p95_ms")
    rows = [
        Row(
            f"resolution p99 (cold) at {fmt(sizes[-1], digits=0)} ÷ at {fmt(sizes[0], digits=0)} revisions",
            ratio,
            "≤ 1.2",
            check(ratio, "<=", 1.2),
        ),
        Row(
            "the same, database server time only (EXPLAIN ANALYZE)",
            get(d, "resolution_server_p99_ratio"),
            "",
            None,
        ),
        Row("resolution p99, cached (worst size)", cached, "< 2 ms", check(cached, "<", 2.0), unit=" ms"),
        Row("list pages p95 (worst page, worst size)", lists, "< 50 ms", check(lists, "<", 50.0), unit=" ms"),
        Row("registration p95 (source_uri, worst size)", get(d, "registration_p95_ms"), "< 50 ms", None, unit=" ms"),
    ]
    rows[-1].ok = check(rows[-1].measured, "<", 50.0)
    return rows


ROWS: dict[str, Callable[[dict], list[Row]]] = {
    "registration": rows_registration,
    "gateway_overhead": rows_gateway_overhead,
    "readiness_isolation": rows_readiness_isolation,
    "live_events": rows_live_events,
    "packing": rows_packing,
    "catalog": rows_catalog,
}

TITLES = {
    "registration": "Registration latency",
    "gateway_overhead": "Gateway overhead",
    "readiness_isolation": "Readiness isolation",
    "live_events": "Live events",
    "packing": "MoE packing",
    "catalog": "Catalog at scale",
}

INTRO = {
    "registration": "Registering a revision over HTTP (daphne, PostgreSQL): from a `source_uri` already in the "
    "store, and as a 10 MB multipart upload, with 1 and 16 concurrent clients.",
    "gateway_overhead": "The same completion requests through the gateway and straight to vLLM, alternating, "
    "on the generated tiny Llama (vLLM CPU).",
    "readiness_isolation": "Steady traffic on warm adapters while new revisions are activated; and each new "
    "adapter's first request against its warm latency.",
    "live_events": "From a committed state change to the message at a dashboard WebSocket.",
    "packing": "Per-expert MoE LoRA tensors packed into one stacked tensor per layer and projection: tensor count, "
    "read time and live vLLM load time, at the paper's shape.",
    "catalog": "PostgreSQL filled with 10^3 … 10^6 revisions over 10^4 tenants; gateway model resolution, "
    "REST list pages and registration measured in-process at each size.",
}


# Findings that explain a benchmark's figures, kept next to them in the report.
NOTES = {
    "catalog": [
        "**Indexes** (adapters/migrations/0002_revision_list_indexes.py). The revisions list pages by `-id` "
        "(`CursorPage`). Without an index on `(adapter_id, id DESC)` PostgreSQL walks the primary key backwards "
        "and filters on `adapter_id`: at 10^6 revisions the first page of a long run that finished long ago "
        "(4,551 revisions, adapter created early) removed 900,153 rows by filter and touched 74,784 buffers: "
        "**1,200 ms**. With `revision_adapter_page (adapter_id, id DESC)` it is an index range scan of 51 "
        "entries: **0.21 ms** (43 buffers); a cursor page (`id < …`) 0.41 ms. A state-filtered page of the "
        "20,000-revision run (`?state=failed`) went from a bitmap scan of 1,008 rows plus a sort (11.5 ms, 988 "
        "buffers) to 51 entries of `revision_adapter_state_page (adapter_id, state, id DESC)` (0.12 ms). Two "
        "indexes that duplicated the unique `(adapter_id, number)` index were dropped (`(adapter_id, number "
        "DESC)`, which the unique index serves read backwards, and the foreign key's own `adapter_id` index), "
        "so registration maintains as many indexes as before. Building the two indexes on 10^6 rows took "
        "about 4 s. Model resolution needed nothing new: its three queries are unique-index lookups "
        "(`adapter_tenant_name_unique`, `alias_adapter_name_unique` or the alias foreign key, "
        "`placement_revision_state`) at every size.",
        "**Known slow plan.** A filter on several states (`?state=registered,validated,pending_approval`) "
        "cannot be read in `-id` order from one index range, and PostgreSQL's estimate (~600 matching rows) "
        "leads it to walk `revision_adapter_page` and filter: when nothing matches, it reads every revision of "
        "that adapter (20,000 rows, ~50-80 ms for the longest run at 10^6). The cost grows with the adapter, "
        "not with the catalog. Fixes, not made here: split a multi-state filter into one ordered query per "
        "state (each an exact `revision_adapter_state_page` range) and merge the pages in the selector, or a "
        "partial index on the transient states if that filter turns out to be common.",
        "**Reading the figures.** Cold resolution is `resolve()` with the gateway's caches cleared: three "
        "indexed queries plus the `sync_to_async` hop; *queries only* is `_resolve_sync` in the calling thread. "
        "Each size lives in its own copy of the catalog and the sizes are measured in interleaved rounds, so "
        "load from other work on this shared 2-core machine falls on every size alike; the 1-minute load "
        "average during each size's rounds is in `catalog.json`. Tail percentiles on a machine at load 3-7 are "
        "set by scheduling, not by the database: the server's own time for the resolution queries (*server "
        "only*) stays at ~0.6 ms p99 from 10^3 to 10^6 revisions and the medians do not move, while a single "
        "burst can lift one size's p95/p99 (compare each page's p50 and p95 in `catalog.json`).",
    ],
}


# ---------------------------------------------------------------------------------------------
# Markdown


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |" for row in rows]
    return out


def generic_rows(d: dict, limit: int = 80) -> list[list[str]]:
    skip = ("machine", "plans", "benchmark", "date", "quick", "results")
    rows = [[path, fmt(value)] for path, value in leaves(d, skip=skip) if path]
    return rows[:limit]


def catalog_sections(d: dict) -> list[str]:
    out: list[str] = []
    results = get(d, "results", default=[]) or []
    if not results:
        return out
    out += ["", "Per size (milliseconds):", ""]
    rows = []
    for r in results:
        rows.append(
            [
                f"{r.get('revisions', 0):,}",
                fmt(get(r, "resolution.cold.p50_ms")),
                fmt(get(r, "resolution.cold.p99_ms")),
                fmt(get(r, "resolution.queries_only.p99_ms")),
                fmt(get(r, "resolution.server_only.p99_ms"), digits=3),
                fmt(get(r, "resolution.cached.p99_ms"), digits=3),
                fmt(get(r, "list_p95_ms")),
                fmt(get(r, "lists.revisions_cursor_walk.p95_ms")),
                fmt(get(r, "registration.p95_ms")),
                fmt(get(r, "load.total_s"), " s"),
                "{}-{}".format(*(fmt(get(r, f"loadavg_1m.{k}"), digits=1) for k in ("min", "max"))),
            ]
        )
    out += table(
        [
            "revisions",
            "resolve cold p50",
            "resolve cold p99",
            "queries only p99",
            "server only p99",
            "resolve cached p99",
            "list p95 (worst)",
            "cursor walk p95",
            "register p95",
            "load",
            "machine load (1 min)",
        ],
        rows,
    )
    last = results[-1]
    shape = last.get("shape") or {}
    tables = last.get("tables") or {}
    if shape or tables:
        out += [
            "",
            f"Shape at {last.get('revisions', 0):,} revisions: "
            + ", ".join(f"{k.replace('_', ' ')} {fmt(v, digits=0)}" for k, v in shape.items())
            + "; "
            + ", ".join(f"{name} {fmt(t.get('rows'), digits=0)} rows" for name, t in sorted(tables.items())),
        ]
    plans = last.get("plans") or []
    if plans:
        out += ["", f"Query plans at {last.get('revisions', 0):,} revisions (EXPLAIN ANALYZE):", ""]
        rows = [
            [
                p.get("path", ""),
                (p.get("sql", "")[:70] + "…").replace("`", "'"),
                ", ".join(dict.fromkeys(p.get("indexes", []))) or "(none)",
                ", ".join(p.get("seq_scans", [])) or ("yes" if p.get("seq_scan") else ""),
                "yes" if p.get("sort") else "",
                fmt(p.get("rows_removed_by_filter"), digits=0),
                fmt(p.get("execution_ms"), digits=3),
            ]
            for p in plans
        ]
        out += table(["path", "query", "indexes", "seq scans", "sort", "rows filtered", "ms"], rows)
    return out


def verdict_rows(name: str, d: dict) -> list[Row]:
    builder = ROWS.get(name)
    if builder is None or "_error" in d:
        return []
    try:
        return builder(d)
    except Exception as exc:  # a shape we did not expect must not stop the report
        return [Row(f"(could not read: {exc!r})", None, "", None)]


def section(name: str, d: dict | None, results: Path) -> list[str]:
    out = [f"## {TITLES.get(name, name)}", ""]
    if name in INTRO:
        out += [INTRO[name], ""]
    if d is None:
        out += [f"Not run yet (`python -m benchmarks.{name}` writes `{name}.json`).", ""]
        return out
    if "_error" in d:
        out += [f"Results file {d['_error']}.", ""]
        return out
    when = d.get("date", "?")
    quick = " **quick run** (small sizes; not the figures to judge by)" if d.get("quick") else ""
    machine = d.get("machine") or {}
    out += [f"Run {when}{quick}; {machine.get('cpus', '?')} CPUs, Python {machine.get('python', '?')}.", ""]
    rows = verdict_rows(name, d)
    if rows:
        out += table(["figure", "measured", "target", "verdict", "MinT paper"], [r.cells() for r in rows])
    if name == "catalog":
        out += catalog_sections(d)
    for note in NOTES.get(name, []):
        out += ["", note]
    if (results / f"{name}.png").exists():
        out += ["", f"![{name}](../benchmarks/results/{name}.png)"]
    if not rows or name == "packing" or all(r.ok is None for r in rows):
        out += ["", "<details><summary>All figures</summary>", ""]
        out += table(["key", "value"], generic_rows(d))
        out += ["", "</details>"]
    out.append("")
    return out


def write_markdown(results: Path, docs: Path) -> Path:
    names = BENCHMARKS + sorted(
        p.stem for p in results.glob("*.json") if p.stem not in BENCHMARKS and p.stem != "index"
    )
    data = {name: load(name, results) for name in names}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.report` from `benchmarks/results/*.json` (`make bench` runs every "
        "benchmark, then this). Each benchmark is `python -m benchmarks.<name> [--quick]`. Figures come from a "
        "2-core CPU machine shared with other work unless a section says otherwise: compare ratios more than "
        "absolute times.",
        "",
        "## Summary",
        "",
    ]
    summary = []
    for name in names:
        d = data[name]
        if d is None:
            summary.append([TITLES.get(name, name), "not run yet", "", ""])
            continue
        rows = [r for r in verdict_rows(name, d) if r.target]
        met = [r for r in rows if r.ok]
        missed = [r for r in rows if r.ok is False]
        verdict = "—" if not rows else ("all met" if not missed else f"{len(missed)} of {len(rows)} missed")
        summary.append(
            [
                TITLES.get(name, name),
                d.get("date", "?") + (" (quick)" if d.get("quick") else ""),
                verdict,
                "; ".join(f"{r.figure} {fmt(r.measured, r.unit)}" for r in (missed or met)[:2]),
            ]
        )
    lines += table(["benchmark", "run", "targets", "headline"], summary)
    lines += [
        "",
        "The MinT paper's figures: registration 1.66 s; MoE packing on Qwen3-30B-A3B (48 layers x 128 experts, "
        "rank 1) 37,248 → 672 tensors, tensor reading 0.3669 s → 0.0067 s (54.8x), live vLLM load "
        "1.36 s → 0.16 s (8.5-8.7x).",
        "",
    ]
    for name in names:
        lines += section(name, data[name], results)
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text("\n".join(lines).rstrip() + "\n")
    return docs


# ---------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], *, ylabel: str, log: bool = False) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=label)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _percentile_bars(ax, items: list[tuple[str, dict]], *, log: bool = False) -> None:
    groups = [label for label, _ in items]
    series = {q: [number(s.get(f"{q}_ms")) for _, s in items] for q in ("p50", "p95", "p99")}
    _bars(ax, groups, series, ylabel="ms", log=log)


def plot_registration(d: dict, plt) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    items = [
        (f"{kind} {clients.replace('clients_', '')} client(s)", get(d, f"{kind}.{clients}") or {})
        for kind in ("source_uri", "upload_10mb")
        for clients in ("clients_1", "clients_16")
    ]
    _percentile_bars(ax, items, log=True)
    ax.axhline(50, color="red", linestyle="--", linewidth=1, label="target p95 (source_uri, 1 client)")
    ax.axhline(1660, color="grey", linestyle=":", linewidth=1, label="MinT paper: 1.66 s")
    ax.legend(fontsize=8)
    ax.set_title("Registration latency")
    return fig


def plot_gateway_overhead(d: dict, plt) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _percentile_bars(ax, [("direct to vLLM", get(d, "direct") or {}), ("through the gateway", get(d, "gateway") or {})])
    ax.set_title(
        f"Gateway overhead: p50 ratio {fmt(get(d, 'p50_ratio'))} (target ≤ 1.05), "
        f"p99 +{fmt(get(d, 'p99_difference_ms'))} ms (≤ 3)",
        fontsize=10,
    )
    return fig


def plot_readiness_isolation(d: dict, plt) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    _percentile_bars(
        left, [("before activations", get(d, "steady_before") or {}), ("during", get(d, "steady_during") or {})]
    )
    left.set_title(f"Steady traffic: p95 ratio {fmt(get(d, 'steady_p95_ratio'))} (target ≤ 1.05)", fontsize=10)
    first = get(d, "first_over_warm") or {}
    keys = [k for k in ("median", "p95", "max") if k in first] if isinstance(first, dict) else []
    right.bar(keys, [first[k] for k in keys], color="tab:purple")
    right.axhline(1.1, color="red", linestyle="--", linewidth=1, label="target 1.1")
    right.set_title("New adapter: first ÷ warm request", fontsize=10)
    right.legend(fontsize=8)
    return fig


def plot_catalog(d: dict, plt) -> Any:
    results = get(d, "results", default=[]) or []
    sizes = [r.get("revisions") for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for path, label in (
        ("resolution.cold.p50_ms", "cold p50"),
        ("resolution.cold.p99_ms", "cold p99"),
        ("resolution.queries_only.p99_ms", "queries only p99"),
        ("resolution.server_only.p99_ms", "server only p99"),
        ("resolution.cached.p99_ms", "cached p99"),
    ):
        ax.plot(sizes, [number(get(r, path)) for r in results], marker="o", label=label)
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="cached target 2 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("revisions in the catalog")
    ax.set_ylabel("ms")
    ax.set_title(f"Model resolution (p99 ratio {fmt(get(d, 'resolution_cold_p99_ratio'))}, target ≤ 1.2)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    cases = sorted({k for r in results for k in (r.get("lists") or {})})
    for case in cases:
        ax.plot(sizes, [number(get(r, f"lists.{case}.p95_ms")) for r in results], marker="o", label=case)
    ax.axhline(50, color="red", linestyle="--", linewidth=1, label="target 50 ms")
    ax.set_xscale("log")
    ax.set_xlabel("revisions in the catalog")
    ax.set_ylabel("p95 ms")
    ax.set_ylim(bottom=0)
    ax.set_title("REST list pages (p95)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[2]
    for q in ("p50", "p95", "p99"):
        ax.plot(sizes, [number(get(r, f"registration.{q}_ms")) for r in results], marker="o", label=q)
    ax.axhline(50, color="red", linestyle="--", linewidth=1, label="target p95 50 ms")
    ax.set_xscale("log")
    ax.set_xlabel("revisions in the catalog")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Registration (source_uri, in-process)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_generic(d: dict, plt) -> Any:
    """Latency summaries as percentile bars; otherwise every top-level number as a bar."""
    items = list(summaries(d))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(items) + 3), 4.5))
    if items:
        _percentile_bars(ax, items, log=max(number(s.get("p99_ms")) or 0 for _, s in items) > 1000)
    else:
        pairs = [(k, number(v)) for k, v in leaves(d, skip=("machine", "plans", "results")) if number(v) is not None]
        pairs = [(k, v) for k, v in pairs if k not in ("quick",)][:20]
        ax.bar([k for k, _ in pairs], [v for _, v in pairs])
        ax.set_xticks(range(len(pairs)), [k for k, _ in pairs], rotation=30, ha="right", fontsize=7)
    ax.set_title(TITLES.get(d.get("benchmark", ""), d.get("benchmark", "results")))
    return fig


PLOTS: dict[str, Callable[[dict, Any], Any]] = {
    "registration": plot_registration,
    "gateway_overhead": plot_gateway_overhead,
    "readiness_isolation": plot_readiness_isolation,
    "catalog": plot_catalog,
}


# Benchmarks that draw their own figure: `plot(figures, png_path) -> bool` in their module.
OWN_PLOTS = {"packing"}


def plot(path: Path) -> Path:
    """Draw `<name>.png` next to a results file `<name>.json`. Returns the PNG's path."""
    plt = _pyplot()
    d = json.loads(Path(path).read_text())
    name = d.get("benchmark") or Path(path).stem
    out = Path(path).with_suffix(".png")
    if name in OWN_PLOTS:
        try:
            from importlib import import_module

            if import_module(f"benchmarks.{name}").plot(d, out):
                return out
        except Exception as exc:
            print(f"report: {name}'s own plot failed ({exc!r}); drawing the generic figure", file=sys.stderr)
        plt.close("all")
    draw = PLOTS.get(name, plot_generic)
    try:
        fig = draw(d, plt)
    except Exception as exc:  # an unexpected shape gets the generic figure rather than none
        print(f"report: {name}: {exc!r}; drawing the generic figure", file=sys.stderr)
        plt.close("all")
        fig = plot_generic(d, plt)
    if d.get("quick"):
        fig.suptitle("quick run", fontsize=8, color="grey", x=0.99, ha="right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--docs",
        type=Path,
        help="the markdown to write (default: docs/benchmarks.md for benchmarks/results, else <out>/benchmarks.md)",
    )
    args = p.parse_args()
    results: Path = args.out
    # Results somewhere else (a smoke test, a trial run) must not overwrite the committed report.
    docs = args.docs or (DOCS if results.resolve() == RESULTS.resolve() else results / "benchmarks.md")
    drawn, failed = [], []
    for path in sorted(results.glob("*.json")):
        try:
            drawn.append(plot(path))
        except Exception as exc:
            failed.append(path.name)
            print(f"report: could not plot {path.name}: {exc!r}", file=sys.stderr)
    written = write_markdown(results, docs)
    print(f"report: {len(drawn)} figure(s) in {results}, summary in {written}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
