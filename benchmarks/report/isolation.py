"""Verdicts of the benchmarks that measure what one tenant's work costs another: activations beside steady
traffic (readiness_isolation), a burst of registrations on the control plane and a hot tenant on a serving node
(noisy_neighbour_control, noisy_neighbour_serving)."""

from __future__ import annotations

from benchmarks.report.data import MISSING, fmt, get, number
from benchmarks.report.row import Row, check


def rows_readiness_isolation(d: dict) -> list[Row]:
    ratio = get(d, "steady_p95_ratio_median", "steady_p95_ratio")
    ci = get(d, "steady_p95_ratio_ci95")
    null_ci = get(d, "steady_p95_null_ratio_ci95")
    first = get(d, "first_over_warm.median", "first_over_warm")
    return [
        Row("steady p95 during ÷ before activations (median of pairs)", ratio, "≤ 1.05", check(ratio, "<=", 1.05)),
        Row("its 95 % interval", f"{fmt(ci[0])} to {fmt(ci[1])}" if ci else "", "", None),
        Row("all windows together", get(d, "steady_p95_ratio"), "", None),
        Row(
            "the same with nothing activated (noise)",
            get(d, "steady_p95_null_ratio_median", "steady_p95_null_ratio"),
            f"{fmt(null_ci[0])} to {fmt(null_ci[1])}" if null_ci else "",
            None,
        ),
        Row("steady p95 after ÷ before activations (what stays)", get(d, "steady_p95_after_ratio"), "", None),
        Row("new adapter first ÷ warm request (median)", first, "≤ 1.1", check(first, "<=", 1.1)),
        Row("new adapter first ÷ warm request (p95 / max)", get(d, "first_over_warm.p95"), "", None),
        Row(
            "activations / window",
            f"{fmt(get(d, 'activated'), digits=0)} in {fmt(get(d, 'pairs'), digits=0)} batches",
            "",
            None,
        ),
        Row("steady errors", fmt(get(d, "steady_errors"), digits=0), "0", check(get(d, "steady_errors"), "<=", 0)),
    ]


def rows_noisy_neighbour_control(d: dict) -> list[Row]:
    median, ci = get(d, "p95_ratio_median"), get(d, "p95_ratio_ci95") or [None, None]
    target = get(d, "target.p95_ratio_median", default=1.2)
    pairs = get(d, "pairs", default=[]) or []
    attacker = get(d, "attacker.answers_by_status", default={}) or {}
    nulls = [v for v in get(d, "null_p95_ratios", default=[]) or [] if number(v) is not None]
    return [
        Row(
            f"B's p95 disturbed ÷ quiet (median of {len(pairs)} pairs)",
            median,
            f"≤ {target}",
            check(median, "<=", target),
        ),
        Row("95 % bootstrap interval of that median", f"{fmt(ci[0])} to {fmt(ci[1])}", "", None),
        Row("pooled p95 ratio (all windows)", get(d, "pooled_p95_ratio"), "", None),
        Row(
            "the same with nobody disturbing: quiet ÷ previous quiet (noise), median and range",
            f"{fmt(get(d, 'null_p95_ratio_median'))} "
            f"({fmt(min(nulls, default=None))} to {fmt(max(nulls, default=None))})",
            "",
            None,
        ),
        Row(
            "B's upload → exported p50 / p95, quiet",
            f"{fmt(get(d, 'quiet.p50_ms'))} / {fmt(get(d, 'quiet.p95_ms'))} ms",
            "",
            None,
        ),
        Row(
            "the same, disturbed",
            f"{fmt(get(d, 'disturbed.p50_ms'))} / {fmt(get(d, 'disturbed.p95_ms'))} ms",
            "",
            None,
        ),
        Row("A's answers by status", ", ".join(f"{k}: {v}" for k, v in attacker.items()), "", None),
        Row("worker pool unchanged", get(d, "worker_pool_survived"), "yes", get(d, "worker_pool_survived")),
    ]


def rows_noisy_neighbour_serving(d: dict) -> list[Row]:
    target = get(d, "target", default={}) or {}
    p95, act, errors = get(d, "p95_ratio_median"), get(d, "activation_ratio_median"), get(d, "b_errors")
    p95_limit, act_limit = target.get("p95_ratio_median", 1.1), target.get("activation_ratio_median", 1.5)
    pairs = len(get(d, "pairs", default=[]) or [])

    def interval(key: str) -> str:
        ci = get(d, key) or [None, None]
        return f"{fmt(ci[0])} to {fmt(ci[1])}"

    def answers(counts: dict | None) -> str:
        return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or MISSING

    return [
        Row(f"B's p95 disturbed ÷ quiet (median of {pairs} pairs)", p95, f"≤ {p95_limit}", check(p95, "<=", p95_limit)),
        Row("95 % bootstrap interval of that median", interval("p95_ratio_ci95"), "", None),
        Row(
            "B's activation → live disturbed ÷ quiet (median)",
            act,
            f"≤ {act_limit}",
            check(act, "<=", act_limit),
        ),
        Row("95 % bootstrap interval of that median", interval("activation_ratio_ci95"), "", None),
        Row(
            "the serving plane's part alone (activation written → flip), disturbed ÷ quiet (median, 95 % CI)",
            f"{fmt(get(d, 'activation_server_ratio_median'))} ({interval('activation_server_ratio_ci95')})",
            "",
            None,
        ),
        Row("B's errors (every non-200)", fmt(errors, digits=0), "0", check(errors, "<=", 0)),
        Row("B's errors by code", answers(get(d, "b_errors_by_code")), "", None),
        Row(
            "noise: quiet ÷ previous quiet, p95 / activation (medians)",
            f"{fmt(get(d, 'null_p95_ratio_median'))} / {fmt(get(d, 'null_activation_ratio_median'))}",
            "",
            None,
        ),
        Row(
            "B's p50 / p95, quiet → disturbed",
            f"{fmt(get(d, 'quiet.p50_ms'))} / {fmt(get(d, 'quiet.p95_ms'))} ms → "
            f"{fmt(get(d, 'disturbed.p50_ms'))} / {fmt(get(d, 'disturbed.p95_ms'))} ms",
            "",
            None,
        ),
        Row("A's flood: requests", answers(get(d, "attacker.flood.requests")), "", None),
        Row("A's flood: unread streams", answers(get(d, "attacker.flood.streams")), "", None),
        Row("A's flood: activations", answers(get(d, "attacker.flood.activations")), "", None),
        Row("A at its rate limit (quiet windows)", answers(get(d, "attacker.quiet.requests")), "", None),
    ]
