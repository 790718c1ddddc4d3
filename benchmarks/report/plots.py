"""One PNG per results file: a figure of its own for each known benchmark, a generic one for the rest."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report.data import LIVE_EVENT_PATHS, TITLES, fmt, get, leaves, number, summaries
from benchmarks.report.long_tail import plot_long_tail
from benchmarks.report.verdicts import live_events_target


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
        f"p99 +{fmt(get(d, 'p99_difference_ms'))} ms (≤ 3), 16 clients' throughput ratio "
        f"{fmt(get(d, 'throughput_ratio'))} (≥ 0.95)",
        fontsize=9,
    )
    return fig


def plot_readiness_isolation(d: dict, plt) -> Any:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2, 2, 1]})
    windows = [("before activations", get(d, "steady_before") or {}), ("during", get(d, "steady_during") or {})]
    after = get(d, "steady_after")
    if after:
        windows.append(("after", after))
    _percentile_bars(left, windows)
    ratio = get(d, "steady_p95_ratio_median", "steady_p95_ratio")
    left.set_title(f"Steady traffic: p95 ratio {fmt(ratio)} (median of pairs; target ≤ 1.05)", fontsize=10)
    series = get(d, "steady_series", default=[]) or []
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95")):
        middle.plot([b["t_s"] for b in series], [b[key] for b in series], marker=".", label=label)
    quiet = number(get(d, "quiet_window_s")) or 0
    start = 0.0
    for k, length in enumerate(get(d, "activation_windows_s", default=[]) or []):
        middle.axvspan(start, start + length, color="tab:orange", alpha=0.15, label="activations" if k == 0 else None)
        start += length + quiet
    window = number(get(d, "activation_window_s"))  # results written before the window pairs
    if window:
        middle.axvspan(0, window, color="tab:orange", alpha=0.15, label="activations")
    middle.set_xlabel("s from the first activation")
    middle.set_ylabel("ms")
    middle.set_ylim(bottom=0)
    middle.set_title("Steady traffic over time", fontsize=10)
    middle.legend(fontsize=8)
    middle.grid(alpha=0.3)
    first = get(d, "first_over_warm") or {}
    keys = [k for k in ("median", "p95", "max") if k in first] if isinstance(first, dict) else []
    right.bar(keys, [first[k] for k in keys], color="tab:purple")
    right.axhline(1.1, color="red", linestyle="--", linewidth=1, label="target 1.1")
    right.set_title("New adapter: first ÷ warm request", fontsize=10)
    right.legend(fontsize=8)
    return fig


def _size_axis(ax, title: str, ylabel: str, *, legend_size: int = 8, log_y: bool = False) -> None:
    """The catalog's panels: a log x-axis of catalog sizes, a legend and a grid."""
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("revisions in the catalog")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)


def plot_catalog(d: dict, plt) -> Any:
    results = get(d, "results", default=[]) or []
    sizes = [r.get("revisions") for r in results]
    big = get(d, "big_tenant.cases", default={}) or {}
    fig, panels = plt.subplots(1, 4 if big else 3, figsize=(21 if big else 15, 4.5))
    resolution, lists, registration = panels[:3]
    for path, label in (
        ("resolution.cold.p50_ms", "cold p50"),
        ("resolution.cold.p99_ms", "cold p99"),
        ("resolution.queries_only.p99_ms", "queries only p99"),
        ("resolution.server_only.p99_ms", "server only p99"),
        ("resolution.cached.p99_ms", "cached p99"),
    ):
        resolution.plot(sizes, [number(get(r, path)) for r in results], marker="o", label=label)
    resolution.axhline(2.0, color="red", linestyle="--", linewidth=1, label="cached target 2 ms")
    ratio = fmt(get(d, "resolution_cold_p99_ratio"))
    _size_axis(resolution, f"Model resolution (p99 ratio {ratio}, target ≤ 1.2)", "ms", log_y=True)
    for case in sorted({k for r in results for k in (r.get("lists") or {})}):
        lists.plot(sizes, [number(get(r, f"lists.{case}.p95_ms")) for r in results], marker="o", label=case)
    lists.axhline(50, color="red", linestyle="--", linewidth=1, label="target 50 ms")
    _size_axis(lists, "REST list pages (p95)", "p95 ms", legend_size=7)
    for q in ("p50", "p95", "p99"):
        registration.plot(sizes, [number(get(r, f"registration.{q}_ms")) for r in results], marker="o", label=q)
    registration.axhline(50, color="red", linestyle="--", linewidth=1, label="target p95 50 ms")
    _size_axis(registration, "Registration (source_uri, in-process)", "ms")
    if big:
        _big_tenant_panel(panels[3], big, get(d, "big_tenant.adapters"))
    return fig


def _big_tenant_panel(ax, cases: dict, adapters: Any) -> None:
    """The tenant with 10^5 adapters: each request's wall p95 and CPU p95, against the 100 ms target."""
    names = list(cases)
    y = list(range(len(names)))
    ax.barh(y, [number(cases[n].get("p95_ms")) or 0 for n in names], color="#9ecae1", label="wall p95")
    ax.barh(y, [number(cases[n].get("cpu_p95_ms")) or 0 for n in names], height=0.4, color="#08519c", label="CPU p95")
    ax.axvline(100, color="red", linestyle="--", linewidth=1, label="target 100 ms")
    ax.set_yticks(y, [n.replace("adapters_", "api ").replace("dashboard_", "page ") for n in names], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"One tenant, {fmt(adapters, digits=0)} adapters: list and search", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")


def plot_live_events(d: dict, plt) -> Any:
    items = [
        (f"{label}\n({fmt(get(d, f'{key}.n'), digits=0)} events)", d[key])
        for key, label in LIVE_EVENT_PATHS
        if isinstance(d.get(key), dict)
    ]
    if not items:
        raise ValueError("no worker_task_changes or service_changes summary")
    target = live_events_target(d)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _percentile_bars(ax, items)
    ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target p95 {target:g} ms")
    ax.legend(fontsize=8)
    ax.set_xticks(range(len(items)), [label for label, _ in items], rotation=0, ha="center", fontsize=8)
    met = d.get("met")
    verdict = "" if not isinstance(met, bool) else (": met" if met else ": missed")
    ax.set_title(f"Live events: commit → dashboard WebSocket (p95 ≤ {target:g} ms{verdict})", fontsize=10)
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


def plot_noisy_neighbour_control(d: dict, plt) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    pairs = get(d, "pairs", default=[]) or []
    groups = [f"pair {i + 1}" for i in range(len(pairs))]
    _bars(
        left,
        groups,
        {
            "quiet p95": [number(get(p, "quiet.p95_ms")) for p in pairs],
            "disturbed p95": [number(get(p, "disturbed.p95_ms")) for p in pairs],
        },
        ylabel="B's upload → exported, ms",
    )
    left.legend(fontsize=8, loc="upper left")
    ratio = left.twinx()
    ratio.plot(range(len(pairs)), [number(p.get("p95_ratio")) for p in pairs], "ko-", label="ratio")
    target = number(get(d, "target.p95_ratio_median")) or 1.2
    ratio.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
    ratio.set_ylim(0, max([target * 1.5] + [number(p.get("p95_ratio")) or 0 for p in pairs]))
    ratio.set_ylabel("disturbed ÷ quiet")
    ratio.legend(fontsize=8, loc="upper right")
    left.set_title(
        f"Median ratio {fmt(get(d, 'p95_ratio_median'))} "
        f"(95 % CI {fmt(get(d, 'p95_ratio_ci95.0'))} to {fmt(get(d, 'p95_ratio_ci95.1'))}), target ≤ {target}",
        fontsize=10,
    )
    stages = get(d, "stages", default={}) or {}
    present = stages.get("quiet") or {}
    names = [n for n in ("upload", "to_dispatch", "validate", "export") if n in present] or list(present)
    _bars(
        right,
        names,
        {kind: [number(get(stages, f"{kind}.{n}.p95_ms")) for n in names] for kind in ("quiet", "disturbed")},
        ylabel="p95, ms",
    )
    right.set_title("Where B's time goes (p95 per stage)", fontsize=10)
    return fig


def plot_noisy_neighbour_serving(d: dict, plt) -> Any:
    """Per pair: B's p95 (left) and B's activation → live (right), quiet and disturbed, with the ratio."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    pairs = get(d, "pairs", default=[]) or []
    groups = [f"pair {i + 1}" for i in range(len(pairs))]
    panels = (
        ("steady.p95_ms", "p95_ratio", "p95_ratio_median", "B's p95, ms", "B's steady traffic"),
        (
            "activation_to_live_s",
            "activation_ratio",
            "activation_ratio_median",
            "activation → live, s",
            "B's activation",
        ),
    )
    for ax, (key, ratio_key, median_key, ylabel, what) in zip(axes, panels, strict=True):
        series = {kind: [number(get(p, f"{kind}.{key}")) for p in pairs] for kind in ("quiet", "disturbed")}
        _bars(ax, groups, series, ylabel=ylabel)
        ax.legend(fontsize=8, loc="upper left")
        ratio = ax.twinx()
        ratio.plot(range(len(pairs)), [number(p.get(ratio_key)) for p in pairs], "ko-", label="ratio")
        target = number(get(d, f"target.{median_key}")) or 1.0
        ratio.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
        ratio.set_ylim(0, 1.1 * max([target * 1.5] + [number(p.get(ratio_key)) or 0 for p in pairs]))
        ratio.set_ylabel("disturbed ÷ quiet")
        ratio.legend(fontsize=8, loc="upper right")
        ci = get(d, median_key.replace("_median", "_ci95")) or [None, None]
        ax.set_title(
            f"{what}: median ratio {fmt(get(d, median_key))} (95 % CI {fmt(ci[0])} to {fmt(ci[1])}), target ≤ {target}",
            fontsize=10,
        )
    return fig


def plot_failover(d: dict, plt) -> Any:
    """Left: per node kill, seconds until each single-replica revision was ready elsewhere, and failed requests.
    Right: the share of revision homes that moved when a node joined, against 1.25/N."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    kills = get(d, "kills", default=[]) or []
    for i, kill in enumerate(kills):
        times = kill.get("recovered_s") or []
        left.scatter([i] * len(times), times, color="tab:blue")
        if kill.get("down_s") is not None:
            left.scatter([i], [kill["down_s"]], color="tab:gray", marker="x")
    left.set_xticks(
        range(len(kills)),
        [f"kill {i + 1}\n{k.get('host')}\n{k.get('failed_replicated')} failed" for i, k in enumerate(kills)],
        fontsize=8,
    )
    left.set_ylabel("seconds after kill -9")
    left.set_title("Ready on the other host (dots), node marked down (x)", fontsize=10)
    rows = get(d, "hashing", default=[]) or []
    after = [r.get("nodes_after") for r in rows]
    right.plot(after, [r.get("moved") for r in rows], "o-", label="moved")
    right.plot(after, [r.get("target") for r in rows], "r--", label="target 1.25/N")
    right.plot(after, [1 / n for n in after], "k:", label="ideal 1/N")
    right.set_xlabel("nodes after one joins (N)")
    right.set_ylabel("share of homes moved")
    right.legend(fontsize=8)
    right.set_title("Rendezvous homes moved when a node joins", fontsize=10)
    return fig


def plot_metering(d: dict, plt) -> Any:
    """Left: counted ÷ seen for requests, prompt and completion tokens. Right: the flush lags' histogram."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [("requests", "requests"), ("prompt", "prompt tokens"), ("completion", "completion tokens")]
    values = [number(get(d, f"{key}_ratio")) or 0 for key, _ in names]
    left.bar([label for _, label in names], values, color="tab:blue")
    left.axhline(1.0, color="red", linestyle="--", linewidth=1, label="target: exactly 1.0")
    for i, value in enumerate(values):
        left.text(i, value, f"{value:.6f}", ha="center", va="bottom", fontsize=9)
    left.set_ylim(0, 1.2)
    left.set_ylabel("counted ÷ seen by the clients")
    left.legend(fontsize=8, loc="lower right")
    left.set_title("Metered ÷ client-seen, 16 concurrent clients", fontsize=10)
    histogram = get(d, "flush_lag_histogram", default={}) or {}
    width, counts = number(histogram.get("bucket_s")) or 1.0, histogram.get("counts") or []
    right.bar([i * width for i in range(len(counts))], counts, width=width, align="edge", color="tab:green")
    interval, p95 = number(get(d, "flush_interval_s")), number(get(d, "flush_lag_p95_s"))
    if interval is not None:
        right.axvline(interval, color="grey", linestyle=":", linewidth=1, label=f"flush interval {interval:g} s")
    if p95 is not None:
        right.axvline(p95, color="black", linestyle="--", linewidth=1, label=f"p95 {p95:.2f} s")
    target = number(get(d, "target.flush_lag_p95_s"))
    if target is not None:
        right.axvline(target, color="red", linestyle="--", linewidth=1, label=f"target p95 ≤ {target:g} s")
    right.set_xlabel("seconds from a request's end to its count in the rows")
    right.set_ylabel("requests")
    right.legend(fontsize=8)
    right.set_title(f"Flush lag ({fmt(get(d, 'flush_lag.measured'), digits=0)} requests)", fontsize=10)
    return fig


def plot_canary(d: dict, plt) -> Any:
    """Left: p50/p95 latency with and without a canary. Right: breach → automatic abort per repeat."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    paths = [("without_canary", "no canary"), ("with_canary", f"canary at {fmt(get(d, 'canary_percent'), digits=0)} %")]
    for offset, (stat, colour) in enumerate((("p50_ms", "tab:blue"), ("p95_ms", "tab:orange"))):
        values = [number(get(d, f"{key}.{stat}")) or 0 for key, _ in paths]
        xs = [i + offset * 0.38 for i in range(len(paths))]
        left.bar(xs, values, width=0.36, color=colour, label=stat.replace("_ms", ""))
        for x, value in zip(xs, values, strict=True):
            left.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=9)
    left.set_xticks([i + 0.19 for i in range(len(paths))], [label for _, label in paths])
    left.set_ylabel("ms per request (one at a time)")
    left.legend(fontsize=8)
    left.set_title(f"Latency, p50 ratio {fmt(get(d, 'p50_ratio'), digits=3)} (target ≤ 1.05)", fontsize=10)
    times = [number(a.get("breach_to_abort_s")) or 0 for a in get(d, "aborts", default=[]) or []]
    right.bar(range(1, len(times) + 1), times, color="tab:green")
    p95, target = number(get(d, "breach_to_abort_p95_s")), number(get(d, "target.breach_to_abort_p95_s"))
    if p95 is not None:
        right.axhline(p95, color="black", linestyle="--", linewidth=1, label=f"p95 {p95:.2f} s")
    if target is not None:
        right.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target p95 ≤ {target:g} s")
    right.set_yscale("log")
    right.set_xlabel("repeat (a failing candidate each)")
    right.set_ylabel("seconds from the breaching request to the abort")
    right.legend(fontsize=8)
    right.set_title("Breach → automatic abort", fontsize=10)
    return fig


PLOTS: dict[str, Callable[[dict, Any], Any]] = {
    "registration": plot_registration,
    "gateway_overhead": plot_gateway_overhead,
    "readiness_isolation": plot_readiness_isolation,
    "live_events": plot_live_events,
    "catalog": plot_catalog,
    "noisy_neighbour_control": plot_noisy_neighbour_control,
    "noisy_neighbour_serving": plot_noisy_neighbour_serving,
    "failover": plot_failover,
    "metering": plot_metering,
    "canary": plot_canary,
    "long_tail": plot_long_tail,
}


# Benchmarks that draw their own figure: `plot(figures, png_path) -> bool` in their module.
OWN_PLOTS = {"packing", "handoff"}


def plot_result(path: Path) -> None:
    """Draw a results file's figure next to it as its benchmark finishes; matplotlib is a dev extra: without it,
    say so and go on."""
    try:
        plot(path)
    except ImportError as exc:
        print(f"{path.stem}: no plot ({exc})", file=sys.stderr)


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
