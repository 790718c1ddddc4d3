"""benchmarks/hostile_edges's verdict rows: anonymous and bad-key floods, and an evaluation beside inference."""

from __future__ import annotations

from benchmarks.report.data import fmt, get
from benchmarks.report.row import Row, check


def _interval(d: dict, key: str) -> str:
    ci = get(d, key) or [None, None]
    return f"{fmt(ci[0])} to {fmt(ci[1])}"


def rows_hostile_edges(d: dict) -> list[Row]:
    pairs = get(d, "pairs")
    anon, errors, evaluation = (
        get(d, "anon_flood_healthz_p95_ratio"),
        get(d, "bad_key_flood_valid_key_errors"),
        get(d, "eval_neighbour_p95_ratio"),
    )
    return [
        Row(f"/healthz p95 anonymous flood ÷ quiet (median of {pairs} pairs)", anon, "≤ 2", check(anon, "<=", 2.0)),
        Row("95 % bootstrap interval of that median", _interval(d, "anon_flood_healthz_p95_ratio_ci95"), "", None),
        Row("another tenant's API reads, the same ratio", get(d, "anon_flood_tenant.median"), "", None),
        Row(
            f"valid-key calls not answered 200 during a flood of random keys from their address (median of {pairs})",
            errors,
            "0",
            check(errors, "<=", 0),
        ),
        Row("95 % bootstrap interval of that median", _interval(d, "bad_key_flood_valid_key_errors_ci95"), "", None),
        Row(
            "valid key p95 during ÷ before the bad-key flood: gateway / REST API",
            f"{fmt(get(d, 'bad_key_flood_valid_key.gateway_p95_ratio.median'))} / "
            f"{fmt(get(d, 'bad_key_flood_valid_key.api_p95_ratio.median'))}",
            "",
            None,
        ),
        Row(
            "another tenant's completion p95 during a 60-case evaluation ÷ before (median of pairs)",
            evaluation,
            "≤ 1.2",
            check(evaluation, "<=", 1.2),
        ),
        Row("95 % bootstrap interval of that median", _interval(d, "eval_neighbour_p95_ratio_ci95"), "", None),
    ]
