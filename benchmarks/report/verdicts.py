"""Verdicts: each benchmark's headline figures against its target (and the MinT paper's)."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.report.data import (
    LIVE_EVENT_PATHS,
    LIVE_EVENTS_TARGET_P95_MS,
    MISSING,
    fmt,
    get,
    number,
    summaries,
)
from benchmarks.report.hostile import rows_hostile_edges
from benchmarks.report.isolation import (
    rows_noisy_neighbour_control,
    rows_noisy_neighbour_serving,
    rows_readiness_isolation,
)
from benchmarks.report.long_tail import rows_long_tail
from benchmarks.report.rollouts import rows_handoff
from benchmarks.report.row import Row, check


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
    ratio, diff, throughput = get(d, "p50_ratio"), get(d, "p99_difference_ms"), get(d, "throughput_ratio")
    own = f"{fmt(get(d, 'gateway_own.p50_ms'))} / {fmt(get(d, 'gateway_own.p99_ms'))} ms"
    return [
        Row("p50 gateway ÷ direct", ratio, "≤ 1.05", check(ratio, "<=", 1.05)),
        Row("p99 gateway - direct", diff, "≤ 3 ms", check(diff, "<=", 3.0), unit=" ms"),
        Row("16 clients: throughput gateway ÷ direct", throughput, "≥ 0.95", check(throughput, ">=", 0.95)),
        Row("gateway's own time p50 / p99", own, "", None),
        Row("direct p50 / p99", f"{fmt(get(d, 'direct.p50_ms'))} / {fmt(get(d, 'direct.p99_ms'))} ms", "", None),
        Row("gateway p50 / p99", f"{fmt(get(d, 'gateway.p50_ms'))} / {fmt(get(d, 'gateway.p99_ms'))} ms", "", None),
    ]


def live_events_target(d: dict) -> float:
    return number(get(d, "target_p95_ms", "target.p95_ms")) or LIVE_EVENTS_TARGET_P95_MS


def rows_live_events(d: dict) -> list[Row]:
    target = live_events_target(d)
    limit = f"≤ {target:g} ms"
    rows = [
        Row(f"{label}: p95", p95, limit, check(p95, "<=", target), unit=" ms")
        for key, label in LIVE_EVENT_PATHS
        if (p95 := get(d, f"{key}.p95_ms")) is not None
    ]
    if rows:
        return rows
    # An older or unknown shape: every latency summary in the file against the target.
    rows = [
        Row(f"{path}: p95", s.get("p95_ms"), limit, check(s.get("p95_ms"), "<=", target), unit=" ms")
        for path, s in summaries(d)
    ]
    return rows or [Row("p95", get(d, "p95_ms"), limit, check(get(d, "p95_ms"), "<=", target))]


def rows_packing(d: dict) -> list[Row]:
    """benchmarks/packing.py's keys first, then a few other likely names; everything shows in the table below."""
    read = get(d, "read.packed.speedup_vs_per_expert", "read_speedup", "speedup.read")
    read_many = get(d, "read.many_file.p50_ms")
    read_before, read_after = get(d, "read.per_expert.p50_ms"), get(d, "read.packed.p50_ms")
    same = get(d, "live_load_summary.packed_vs_per_expert_same_sized_node")
    tied = get(d, "live_load_summary.tied_vs_per_expert_same_rank1_node")
    plugin_same = get(d, "live_load_summary.expert_major_vs_per_expert_same_plugin_node")
    plugin_generic = get(d, "live_load_summary.expert_major_vs_generic_per_expert")
    generic = get(d, "live_load_summary.best_packed_vs_generic_per_expert")
    load_before = get(d, "live_load_summary.per_expert_generic_ms")
    load_after = get(d, "live_load.sized.loads.packed.p50_ms")
    before = get(d, "tensors.per_expert", "tensors_before", "tensors.before")
    after = get(d, "tensors.packed", "tensors_after", "tensors.after")
    x = "x"
    return [
        Row(
            "tensors before → after (3-D PEFT layout; expert-major: 6 per MoE layer)",
            f"{fmt(before, digits=0)} → {fmt(after, digits=0)}",
            "",
            None,
            "37,248 → 672",
        ),
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
        Row(
            "live vLLM load speed-up, expert-major with MinT's vLLM plugin (untied, same rank-1 node)",
            plugin_same,
            "≥ 10x",
            check(plugin_same, ">=", 10),
            "8.5-8.7x",
            x,
        ),
        Row("live load speed-up, 3-D PEFT layout on plain vLLM (untied at 2r, same sized node)", same, "", None, "", x),
        Row("live load speed-up, 3-D PEFT layout, gate/up tied (rank-1 node)", tied, "", None, "", x),
        Row("live load speed-up, expert-major vs per-expert on a generic node", plugin_generic, "", None, "", x),
        Row(
            "live load speed-up, best packed vs per-expert on a generic node",
            generic,
            "",
            None,
            "1.36 s → 0.16 s",
            x,
        ),
        Row(
            "live load p50: per-expert (generic node) → packed (sized node)",
            f"{fmt(load_before, ' ms')} → {fmt(load_after, ' ms')}",
            "",
            None,
        ),
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
    adapters = fmt(get(d, "big_tenant.adapters"), digits=0)
    for key, what in (
        ("adapter_list_p95_ms", "API list"),
        ("adapter_search_p95_ms", "API search"),
        ("dashboard_list_p95_ms", "dashboard list"),
        ("dashboard_search_p95_ms", "dashboard search"),
    ):
        value = get(d, key)
        figure = f"one tenant with {adapters} adapters: {what} p95 (worst case)"
        rows.append(Row(figure, value, "< 100 ms", check(value, "<", 100.0), unit=" ms"))
    return rows


def rows_failover(d: dict) -> list[Row]:
    failed, requests = get(d, "failed_replicated_total"), get(d, "requests_replicated_total")
    kills = get(d, "kills", default=[]) or []
    drain_failed = get(d, "drain_failed")
    moved = get(d, "hash_moved_max_ratio_to_target")
    return [
        Row(
            f"requests to the replicated adapter failed during {len(kills)} node kills (of {fmt(requests, digits=0)})",
            fmt(failed, digits=0),
            "0",
            check(failed, "<=", 0),
        ),
        Row(
            "seconds until a single-replica live revision is ready on the other host (median / max)",
            f"{fmt(get(d, 'recovered_s_median'))} / {fmt(get(d, 'recovered_s_max'))} s",
            "",
            None,
        ),
        Row(
            "single-replica revisions never recovered",
            fmt(get(d, "not_recovered_total"), digits=0),
            "0",
            check(get(d, "not_recovered_total"), "<=", 0),
        ),
        Row("seconds until the killed node was marked down", ", ".join(fmt(k.get("down_s")) for k in kills), "", None),
        Row(
            f"requests failed during a drain (of {fmt(get(d, 'drain.requests'), digits=0)}, "
            f"{fmt(get(d, 'drain.drain_s'))} s)",
            fmt(drain_failed, digits=0),
            "0",
            check(drain_failed, "<=", 0),
        ),
        Row("homes moved when a node joins, worst ÷ 1.25/N", moved, "≤ 1", check(moved, "<=", 1.0)),
    ]


def rows_metering(d: dict) -> list[Row]:
    interval = number(get(d, "flush_interval_s"))
    lag, lag_target = get(d, "flush_lag_p95_s"), get(d, "target.flush_lag_p95_s")
    quiet = get(d, "quiet_tail", default={}) or {}
    written = quiet.get("written_without_a_request")
    seen, counted = get(d, "seen", default={}) or {}, get(d, "counted", default={}) or {}

    def exact(key: str) -> Row:
        value = get(d, f"{key}_ratio")
        what = {"requests": "requests", "prompt": "prompt tokens", "completion": "completion tokens"}[key]
        field = "requests" if key == "requests" else f"{key}_tokens"
        figure = f"{what} counted ÷ seen by the clients ({fmt(counted.get(field))} ÷ {fmt(seen.get(field))})"
        v = number(value)
        return Row(figure, MISSING if v is None else f"{v:.6f}", "= 1.0", None if v is None else v == 1.0)

    pending = quiet.get("still_pending_after_wait")
    return [
        exact("prompt"),
        exact("completion"),
        exact("requests"),
        Row(
            f"flush lag p95: request end → in the rows (flush every {fmt(interval)} s)",
            lag,
            f"≤ {fmt(lag_target)} s",
            None if number(lag_target) is None else check(lag, "<=", number(lag_target)),
            unit=" s",
        ),
        Row(
            "flush lag p50 / max",
            f"{fmt(get(d, 'flush_lag.p50_ms'))} / {fmt(get(d, 'flush_lag.max_ms'))} ms",
            "",
            None,
        ),
        Row(
            f"last requests before a quiet spell in the rows with no request after them "
            f"(waited {fmt(quiet.get('waited_s'))} s)",
            "yes" if written else (MISSING if written is None else f"no: {fmt(pending, digits=0)} pending"),
            "yes",
            None if written is None else bool(written),
        ),
        Row(
            "16 clients: requests/s, latency p50 / p95",
            f"{fmt(get(d, 'requests_per_second'))}/s, {fmt(get(d, 'request_latency.p50_ms'))} / "
            f"{fmt(get(d, 'request_latency.p95_ms'))} ms",
            "",
            None,
        ),
    ]


def rows_canary(d: dict) -> list[Row]:
    ratio, p95 = get(d, "p50_ratio"), get(d, "breach_to_abort_p95_s")
    return [
        Row("p50 with a canary at 20 % ÷ without", ratio, "≤ 1.05", check(ratio, "<=", 1.05)),
        Row(
            f"failing candidate: breach → automatic abort, p95 of {fmt(get(d, 'breach_to_abort_s.n'), digits=0)}",
            p95,
            "≤ 5 s",
            check(p95, "<=", 5.0),
            unit=" s",
        ),
        Row(
            "breach → abort p50 / max",
            f"{fmt(get(d, 'breach_to_abort_s.p50'))} / {fmt(get(d, 'breach_to_abort_s.max'))} s",
            "",
            None,
        ),
        Row(
            "p50 with / without a canary",
            f"{fmt(get(d, 'with_canary.p50_ms'))} / {fmt(get(d, 'without_canary.p50_ms'))} ms",
            "",
            None,
        ),
    ]


def rows_upload(d: dict) -> list[Row]:
    ratio = get(d, "throughput_ratio")
    only = get(d, "resume.only_unfinished_resent")
    resent = f"{fmt(get(d, 'resume.parts_resent'), digits=0)} of {fmt(get(d, 'resume.parts'), digits=0)}"
    return [
        Row("resumable ÷ one multipart POST, MB/s (medians)", ratio, "≥ 0.9", check(ratio, ">=", 0.9)),
        Row(
            f"parts sent again after a cut at 50 % ({resent})",
            "only the unfinished" if only else "more",
            "only the unfinished",
            bool(only) if only is not None else None,
        ),
        Row(
            "MB/s one POST / resumable (medians)",
            f"{fmt(get(d, 'one_post_mb_per_s.median'))} / {fmt(get(d, 'resumable_mb_per_s.median'))}",
            "",
            None,
        ),
        Row(
            "after the cut: to the revision's 201; same digest as the one POST",
            f"{fmt(get(d, 'resume.resume_to_revision_s'))} s; {get(d, 'resume.sha256_identical')}",
            "",
            None,
        ),
    ]


ROWS: dict[str, Callable[[dict], list[Row]]] = {
    "registration": rows_registration,
    "gateway_overhead": rows_gateway_overhead,
    "readiness_isolation": rows_readiness_isolation,
    "live_events": rows_live_events,
    "packing": rows_packing,
    "catalog": rows_catalog,
    "noisy_neighbour_control": rows_noisy_neighbour_control,
    "noisy_neighbour_serving": rows_noisy_neighbour_serving,
    "failover": rows_failover,
    "metering": rows_metering,
    "canary": rows_canary,
    "upload": rows_upload,
    "long_tail": rows_long_tail,
    "handoff": rows_handoff,
    "hostile_edges": rows_hostile_edges,
}


def verdict_rows(name: str, d: dict) -> list[Row]:
    builder = ROWS.get(name)
    if builder is None or "_error" in d:
        return []
    try:
        return builder(d)
    except Exception as exc:  # a shape we did not expect must not stop the report
        return [Row(f"(could not read: {exc!r})", None, "", None)]
