"""The figures of a run: ratios per window pair, their medians and bootstrap intervals."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from dataclasses import asdict

from benchmarks.common import (
    bootstrap_median,
    percentile,
    summary_ms,
)
from benchmarks.noisy_neighbour_serving import TARGET, Params
from benchmarks.noisy_neighbour_serving.clients import Clients


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0 or num != num or den != den:
        return None
    return num / den


def _ci(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    low, high = bootstrap_median(values)
    return [round(low, 3), round(high, 3)]


def figures(windows, clients: Clients, params: Params, plans, *, audit, a_end, span) -> dict:
    def latencies(w: dict) -> list[float]:
        return [s.seconds for s in clients.between(w["start"], w["end"]) if s.outcome == "200"]

    def upstream(disturbed: bool) -> list[float]:
        return [
            s.upstream_ms / 1000
            for w in windows
            if w["disturbed"] is disturbed
            for s in clients.between(w["start"], w["end"])
            if s.outcome == "200" and s.upstream_ms is not None
        ]

    def activation_s(w: dict) -> float | None:
        return w["activation"].live_s

    def flip_s(w: dict) -> float | None:
        """POST → the flip's audit record: the REST-observed time less the polling's lag."""
        at = audit.get(f"r{w['activation'].number}", {}).get("alias.flip")
        return round(at - w["activation"].posted_at, 3) if at else None

    def server_s(w: dict) -> float | None:
        """The activation's write → the flip: the serving plane's part (converge, admission, prewarm, flip)."""
        times = audit.get(f"r{w['activation'].number}", {})
        if "alias.activate" not in times or "alias.flip" not in times:
            return None
        return round(times["alias.flip"] - times["alias.activate"], 3)

    pairs = []
    for pair in range(params.pairs):
        quiet, loud = (next(w for w in windows if w["pair"] == pair and w["disturbed"] is d) for d in (False, True))
        p95 = _ratio(percentile(latencies(loud), 95), percentile(latencies(quiet), 95))
        act = _ratio(activation_s(loud), activation_s(quiet))
        server = _ratio(server_s(loud), server_s(quiet))
        pairs.append(
            {
                "order": "disturbed first" if pair % 2 else "quiet first",
                **{
                    kind: {
                        "steady": summary_ms(latencies(w)),
                        "activation_to_live_s": None if activation_s(w) is None else round(activation_s(w), 3),
                        "activation_to_flip_s": flip_s(w),
                        "activation_post": w["activation"].outcome,
                        "activation_post_s": round(w["activation"].post_s, 3),
                        "activation_server_s": server_s(w),
                        "a_request_rate": w["a"]["request_rate"],
                        "settle_before_s": w["settle_before_s"],
                        "rate_window_wait_s": w["rate_window_wait_s"],
                        "loadavg_1m": w["loadavg_1m"],
                        "cpu": w["cpu"],
                    }
                    for kind, w in (("quiet", quiet), ("disturbed", loud))
                },
                "p95_ratio": None if p95 is None else round(p95, 3),
                "activation_ratio": None if act is None else round(act, 3),
                "activation_server_ratio": None if server is None else round(server, 3),
            }
        )
    p95s = [p["p95_ratio"] for p in pairs if p["p95_ratio"] is not None]
    acts = [p["activation_ratio"] for p in pairs if p["activation_ratio"] is not None]
    servers = [p["activation_server_ratio"] for p in pairs if p["activation_server_ratio"] is not None]
    # The same ratios with nobody disturbing: each quiet window against the previous quiet one.
    quiet_windows = [w for w in windows if not w["disturbed"]]
    null_p95 = [
        _ratio(percentile(latencies(later), 95), percentile(latencies(earlier), 95))
        for earlier, later in itertools.pairwise(quiet_windows)
    ]
    null_act = [
        _ratio(activation_s(later), activation_s(earlier)) for earlier, later in itertools.pairwise(quiet_windows)
    ]
    null_p95 = [round(r, 3) for r in null_p95 if r is not None]
    null_act = [round(r, 3) for r in null_act if r is not None]

    # Every answer B got that was not a 200, over the whole measured span (settling included), by kind and code.
    b_errors: Counter = Counter()
    b_errors.update(f"steady {s.outcome}" for s in clients.between(*span) if s.outcome != "200")
    # The steady traffic's errors by where they fell: in quiet windows, disturbed ones, or while settling.
    by_kind: dict[str, Counter] = {"quiet": Counter(), "disturbed": Counter(), "settling": Counter()}
    for s in clients.between(*span):
        if s.outcome != "200":
            w = next((w for w in windows if w["start"] <= s.sent < w["end"]), None)
            by_kind["settling" if w is None else "disturbed" if w["disturbed"] else "quiet"][s.outcome] += 1
    for w in windows:
        act = w["activation"]
        if act.outcome != "200":
            b_errors[f"activate {act.outcome}"] += 1
        elif act.live_s is None:
            b_errors["activate never_live_within_timeout"] += 1
        for code, n in act.polls.items():
            if code != "200":
                b_errors[f"poll {code}"] += n
    errors = sum(b_errors.values())

    def tally(disturbed: bool) -> dict:
        totals: dict[str, Counter] = {}
        for w in windows:
            if w["disturbed"] is disturbed:
                for kind, counts in w["a"]["tally"].items():
                    totals.setdefault(kind, Counter()).update(counts)
        rates = [w["a"]["request_rate"] for w in windows if w["disturbed"] is disturbed]
        delivered = [n for w in windows if w["disturbed"] is disturbed for n in w["a"].get("stream_bytes", [])]
        return {
            **{kind: dict(sorted(c.items())) for kind, c in totals.items() if c},
            "request_rate_median": statistics.median(rates) if rates else None,
            # What each admitted stream had put in its socket by the window's end (headers included).
            **({"stream_bytes_median": statistics.median(delivered)} if delivered else {}),
        }

    p95_median = statistics.median(p95s) if p95s else None
    act_median = statistics.median(acts) if acts else None
    all_quiet = [v for w in windows if not w["disturbed"] for v in latencies(w)]
    all_loud = [v for w in windows if w["disturbed"] for v in latencies(w)]
    a_answers = Counter()
    for w in windows:
        for counts in w["a"]["tally"].values():
            a_answers.update({k.split(":", 1)[0]: v for k, v in counts.items()})
    return {
        "target": TARGET,
        "p95_ratio_median": None if p95_median is None else round(p95_median, 3),
        "p95_ratio_ci95": _ci(p95s),
        "p95_met": p95_median is not None and p95_median <= TARGET["p95_ratio_median"],
        "activation_ratio_median": None if act_median is None else round(act_median, 3),
        "activation_ratio_ci95": _ci(acts),
        "activation_met": act_median is not None and act_median <= TARGET["activation_ratio_median"],
        # The same ratio for the serving plane's part alone (the activation's write → the flip, from the audit
        # log): what is left once the REST API's answer to the POST and the polling are taken out.
        "activation_server_ratio_median": round(statistics.median(servers), 3) if servers else None,
        "activation_server_ratio_ci95": _ci(servers),
        "b_errors": errors,
        "b_errors_by_code": dict(sorted(b_errors.items())),
        "b_errors_met": errors <= TARGET["b_errors"],
        "b_steady_errors_by_window_kind": {kind: dict(sorted(c.items())) for kind, c in by_kind.items()},
        "met": bool(
            p95_median is not None
            and p95_median <= TARGET["p95_ratio_median"]
            and act_median is not None
            and act_median <= TARGET["activation_ratio_median"]
            and errors <= TARGET["b_errors"]
        ),
        "null_p95_ratios": null_p95,
        "null_p95_ratio_median": round(statistics.median(null_p95), 3) if null_p95 else None,
        "null_activation_ratios": null_act,
        "null_activation_ratio_median": round(statistics.median(null_act), 3) if null_act else None,
        "quiet": summary_ms(all_quiet),
        "disturbed": summary_ms(all_loud),
        # CPU per part of the stack (1.0 = one CPU busy), the median over each kind of window: who pays.
        "cpu_share_median": {
            kind: {
                part: round(statistics.median(w["cpu"].get(part, 0.0) for w in ws), 3)
                for part in sorted({part for w in ws for part in w["cpu"]})
            }
            for kind, ws in (
                ("quiet", [w for w in windows if not w["disturbed"]]),
                ("disturbed", [w for w in windows if w["disturbed"]]),
            )
            if ws
        },
        # The node's part of the same requests (the gateway's Server-Timing): the engine's share of a change.
        "quiet_upstream": summary_ms(upstream(False)),
        "disturbed_upstream": summary_ms(upstream(True)),
        "activation_to_live_s": {
            kind: [
                None if activation_s(w) is None else round(activation_s(w), 3) for w in windows if w["disturbed"] is d
            ]
            for kind, d in (("quiet", False), ("disturbed", True))
        },
        # How long the REST API took to answer B's POST …/activate/ (the web process also serves A's flood).
        "activation_post_s": {
            kind: [round(w["activation"].post_s, 3) for w in windows if w["disturbed"] is d]
            for kind, d in (("quiet", False), ("disturbed", True))
        },
        "pairs": pairs,
        "attacker": {
            # Every answer A got, by status alone, then by window kind, what was sent and status:code.
            "answers_by_status": dict(sorted(a_answers.items())),
            "quiet": tally(False),
            "flood": tally(True),
            "at_end": a_end,
        },
        "params": asdict(params),
        "plans": plans,
    }
