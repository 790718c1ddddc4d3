"""The live run's figures, from the client records, the windows, the ready times and the tier counters.

Definitions (also written into the results file under `definitions`):

- A *request* is one `completions.create` of the `openai` client (up to three attempts); it *succeeded* when it
  returned a completion. `openai_success_ratio` counts every request but those of the thrashing phase (a
  deliberate overload, whose excess is to be refused with an honest Retry-After: `thrash_phase` has its figures;
  `openai_success_ratio_with_thrashing` counts all). Warm-up requests count for success, not for hit ratios.
- A request *hit* the CPU tier when its first attempt was answered (not 503): its revision was loaded. Tiers are
  inclusive (what is in vLLM's GPU batch is loaded; what is loaded has its files on disk): `hit_ratio_gpu` is the
  CPU hit ratio times the share of routed requests the gateway found in its model of the GPU batch;
  `hit_ratio_disk` adds the misses whose load found the files on the node (loads from disk ÷ loads).
- A *cold start* is a successful request whose first attempt got 503: its latency, first attempt to completion.
- `Retry-After` honesty: per 503 `adapter_not_ready`, the seconds it gave ÷ the seconds until its revision was
  next ready on the node (from the polled `ready_at`); a revision never ready again before the run ended counts as
  ratio 0, one already ready (the gateway's cached route lagging) is left out and counted.
- The node's *load slot*: a load holds it from its admission to ready (`started_at` → `ready_at`: the agent's
  hand-offs, fetch, load, warm-up and bookkeeping). `load_slot` gives, per phase, the share of the time at least
  one load held it (`busy_share`) and a load's median time there: with a share well below one the node's load
  rate is not what bounds that phase; what waits then waits for room or for its tenant's pacing.
- LRU and Belady: the requests in the order they started, replayed through a plain LRU and Belady's optimum of
  `cpu_slots` entries (benchmarks/long_tail/offline.py), whatever the live node did.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter

import numpy as np

from benchmarks.common import bootstrap_median, percentile
from benchmarks.long_tail.offline import belady_hits, lru_hits

TARGET = {
    "openai_success_ratio": 0.999,
    "cold_start_p95_s": 2.0,
    "retry_after_ratio_median": [1.0, 2.0],
    "hot_p95_ratio_median": 1.1,
    "scan_hit_gain_vs_lru": 0.10,
    "sim_decisions_per_s": 100_000,
}


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or value != value else round(float(value), digits)


def _ci(values: list[float]) -> list[float] | None:
    return [round(x, 4) for x in bootstrap_median(values)] if len(values) > 1 else None


def _mean(flags) -> float | None:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else None


def _window_of(windows: list[dict], at: float) -> dict | None:
    for w in windows:
        if w["start"] <= at < w["end"]:
            return w
    return None


def _phase(record: dict) -> str:
    """The kind of window a request started in (`after`: once the windows were over)."""
    return (record["window"] or {}).get("kind", "after")


def _retry_after(records, revision_of, ready, intervals) -> dict:
    ratios, stale, never, given_s = [], 0, 0, []
    by_kind: dict[str, list[float]] = {}
    for rec in records:
        revision = revision_of[rec["alias"]]
        for _sent, answered, status, retry_after, code in rec["attempts"]:
            if status != 503 or code != "adapter_not_ready" or retry_after is None:
                continue
            if any(start <= answered <= end for start, end in intervals.get(revision, ())):
                stale += 1
                continue
            times = ready.get(revision, [])
            k = bisect.bisect_left(times, answered)
            if k == len(times):
                never += 1
                ratio = 0.0
            else:
                ratio = retry_after / max(times[k] - answered, 1e-3)
            ratios.append(ratio)
            given_s.append(retry_after)
            by_kind.setdefault(rec["kind"], []).append(ratio)
    return {
        "median": _r(statistics.median(ratios)) if ratios else None,
        "p10": _r(percentile(ratios, 10)) if ratios else None,
        "p90": _r(percentile(ratios, 90)) if ratios else None,
        "within_1_to_2": _r(_mean(1 <= r <= 2 for r in ratios)),
        "too_early": _r(_mean(0 < r < 1 for r in ratios)),  # the client came back before it was ready
        "answers": len(ratios),
        "never_ready": never,
        "already_ready": stale,
        "given_s_median": _r(statistics.median(given_s)) if given_s else None,
        "median_by_kind": {k: _r(statistics.median(v)) for k, v in sorted(by_kind.items())},
    }


def _load_slot(loads: list[list[float]], windows: list[dict]) -> dict:
    """Per phase kind: the share of its windows' time at least one load held the node's load slot, the loads that
    became ready in them, and their median time from admission to ready."""
    found = {}
    for kind in dict.fromkeys(w["kind"] for w in windows):
        spans = [w for w in windows if w["kind"] == kind]
        seconds = sum(w["end"] - w["start"] for w in spans)
        busy, held = 0.0, []
        for w in spans:
            reach = w["start"]  # the union of the loads' spans inside the window, swept in start order
            for started, ready in loads:
                if w["start"] <= ready < w["end"]:
                    held.append(ready - started)
                lo, hi = max(started, reach), min(ready, w["end"])
                if hi > lo:
                    busy += hi - lo
                    reach = hi
        found[kind] = {
            "busy_share": _r(busy / seconds, 3) if seconds else None,
            "loads": len(held),
            "slot_s_median": _r(statistics.median(held), 3) if held else None,
        }
    return found


def live_figures(run: dict) -> dict:
    params, windows = run["params"], run["windows"]
    records = sorted(run["records"], key=lambda r: r["start"])
    revision_of = run["revision_of"]
    ready = {int(k): v for k, v in run["ready"].items()}
    intervals = {int(k): v for k, v in run.get("ready_intervals", {}).items()}
    for rec in records:
        rec["window"] = _window_of(windows, rec["start"])
        rec["ok"] = not rec["error"]
        rec["hit"] = bool(rec["attempts"]) and rec["attempts"][0][2] != 503
    # Success, and every answer other than 200 and 503 a request saw on its way.
    by_kind = Counter(r["kind"] for r in records)
    ok_by_kind = Counter(r["kind"] for r in records if r["ok"])
    others = Counter(f"{a[2]} {a[4]}".strip() for r in records for a in r["attempts"] if a[2] not in (200, 503))
    failures = Counter(f"{r['kind']}: {r['error']}" for r in records if not r["ok"])
    phases = Counter(_phase(r) for r in records)
    ok_phases = Counter(_phase(r) for r in records if r["ok"])

    cold = [r["latency"] for r in records if r["ok"] and r["attempts"] and r["attempts"][0][2] == 503]
    cold_by_kind = {
        kind: _r(percentile([r["latency"] for r in records if r["kind"] == kind and r["ok"] and not r["hit"]], 95), 3)
        for kind in sorted(by_kind)
    }
    cold_by_phase = {
        phase: _r(percentile(cold_in, 95), 3)
        for phase in sorted(phases)
        if (cold_in := [r["latency"] for r in records if r["ok"] and not r["hit"] and _phase(r) == phase])
    }

    # Hot tenant's p95, scan ÷ quiet per pair.
    pairs = []
    for pair in sorted({w["pair"] for w in windows if w["pair"] is not None}):
        p95 = {}
        for w in (w for w in windows if w["pair"] == pair):
            lat = [r["latency"] for r in records if r["kind"] == "hot" and r["window"] is w]
            p95[w["kind"]] = (percentile(lat, 95) if lat else None, len(lat))
        q, s = p95.get("quiet", (None, 0)), p95.get("scan", (None, 0))
        if q[0] and s[0]:
            pairs.append(
                {
                    "quiet_p95_ms": _r(q[0] * 1000, 3),
                    "scan_p95_ms": _r(s[0] * 1000, 3),
                    "ratio": _r(s[0] / q[0]),
                    "n": [q[1], s[1]],
                }
            )
    ratios = [p["ratio"] for p in pairs]

    # Hit ratios: measured, and the same sequence through LRU and Belady at the CPU tier's size.
    keys = np.array([revision_of[r["alias"]] for r in records], dtype=np.int64)
    lru = lru_hits(keys, params["cpu_slots"])
    belady = belady_hits(keys, params["cpu_slots"])
    mask = np.array([r["window"] is not None and r["window"]["kind"] != "warmup" for r in records], dtype=bool)
    hits = np.array([r["hit"] for r in records], dtype=bool)
    in_scan = np.array([(r["window"] or {}).get("kind") == "scan" for r in records], dtype=bool)
    not_scan = np.array([r["kind"] != "scan" for r in records], dtype=bool)
    others_in_scan = in_scan & not_scan

    def ratio_of(flags: np.ndarray, where: np.ndarray) -> float | None:
        return _r(flags[where].mean()) if where.any() else None

    delta = {
        node: {
            k: run["tiers_after"].get(node, {}).get(k, 0) - run["tiers_before"].get(node, {}).get(k, 0)
            for k in set(run["tiers_after"].get(node, {})) | set(run["tiers_before"].get(node, {}))
        }
        for node in run["tiers_after"]
    }
    node_counts = next((v for k, v in delta.items() if k != "-"), {})
    routed = node_counts.get("gpu", 0) + node_counts.get("cpu", 0)
    gpu_share = node_counts.get("gpu", 0) / routed if routed else None
    loads = node_counts.get("loads", 0)
    disk_share = node_counts.get("from_disk", 0) / loads if loads else None
    cpu_ratio = ratio_of(hits, mask)
    minutes = [(m, row) for m, row in run["per_minute"] if run["started"] - 60 <= m <= run["ended"]]

    def per_minute(kind: str, field: str) -> float | None:
        """`field` of the node's tier counters a minute, over the windows of `kind`."""
        spans = [w for w in windows if w["kind"] == kind and "tiers" in w]
        seconds = sum(w["end"] - w["start"] for w in spans)
        return _r(sum(w["tiers"].get(field, 0) for w in spans) * 60 / seconds, 2) if seconds else None

    thrash = [r for r in records if (r["window"] or {}).get("kind") == "thrash"]
    quiet = [r for r in records if (r["window"] or {}).get("kind") == "quiet"]
    retry = _retry_after(records, revision_of, ready, intervals)
    others_hit, others_lru = ratio_of(hits, others_in_scan), ratio_of(lru, others_in_scan)
    return {
        "live_aliases": run["live_aliases"],
        "requests": len(records),
        # The stream the node is meant to carry: everything but the thrashing phase (a deliberate overload whose
        # excess is meant to be refused with an honest Retry-After: its own figures are under thrash_phase).
        "openai_success_ratio": _r(_mean(r["ok"] for r in records if (r["window"] or {}).get("kind") != "thrash"), 5),
        "openai_success_ratio_with_thrashing": _r(_mean(r["ok"] for r in records), 5),
        "success_ratio_by_kind": {k: _r(ok_by_kind[k] / n, 5) for k, n in sorted(by_kind.items())},
        "success_ratio_by_phase": {k: _r(ok_phases[k] / n, 5) for k, n in sorted(phases.items())},
        "requests_by_kind": dict(sorted(by_kind.items())),
        "failures": dict(failures.most_common()),
        "errors_other_than_503": dict(others.most_common()),
        "cold_starts": len(cold),
        "cold_start_p50_s": _r(percentile(cold, 50), 3) if cold else None,
        "cold_start_p95_s": _r(percentile(cold, 95), 3) if cold else None,
        "cold_start_max_s": _r(max(cold), 3) if cold else None,
        "cold_start_p95_s_by_kind": cold_by_kind,
        "cold_start_p95_s_by_phase": cold_by_phase,
        "retry_after_ratio_median": retry["median"],
        "retry_after": retry,
        "hot_pairs": pairs,
        "hot_p95_ratio_median": _r(statistics.median(ratios)) if ratios else None,
        "hot_p95_ratio_ci95": _ci(ratios),
        "hit_ratio_cpu": cpu_ratio,
        "hit_ratio_gpu": _r(cpu_ratio * gpu_share) if cpu_ratio is not None and gpu_share is not None else None,
        "hit_ratio_disk": _r(cpu_ratio + (1 - cpu_ratio) * disk_share)
        if cpu_ratio is not None and disk_share is not None
        else None,
        "cpu_hit_ratio_lru": ratio_of(lru, mask),
        "cpu_hit_ratio_belady": ratio_of(belady, mask),
        "scan_hit_gain_vs_lru": _r(others_hit - others_lru)
        if others_hit is not None and others_lru is not None
        else None,
        "scan_phase": {
            "others_hit_ratio": others_hit,
            "others_hit_ratio_lru": others_lru,
            "others_hit_ratio_belady": ratio_of(belady, others_in_scan),
            "all_hit_ratio": ratio_of(hits, in_scan),
            "all_hit_ratio_lru": ratio_of(lru, in_scan),
            "scanned": sum(1 for r in records if r["kind"] == "scan"),
            "scanned_ok": sum(1 for r in records if r["kind"] == "scan" and r["ok"]),
        },
        "quiet_phase": {
            "hit_ratio": ratio_of(hits, np.array([(r["window"] or {}).get("kind") == "quiet" for r in records])),
            "hit_ratio_lru": ratio_of(lru, np.array([(r["window"] or {}).get("kind") == "quiet" for r in records])),
        },
        "thrash_phase": {
            "requests": len(thrash),
            "success_ratio": _r(_mean(r["ok"] for r in thrash), 5),
            "first_attempt_hit_ratio": _r(_mean(r["hit"] for r in thrash)),
            "served_p50_ms": _r(percentile([r["latency"] for r in thrash if r["ok"] and r["hit"]], 50) * 1000, 3)
            if any(r["ok"] and r["hit"] for r in thrash)
            else None,
            "served_p95_ms": _r(percentile([r["latency"] for r in thrash if r["ok"] and r["hit"]], 95) * 1000, 3)
            if any(r["ok"] and r["hit"] for r in thrash)
            else None,
            # What is served (first attempt answered) during the overload against the same in quiet windows.
            "served_p95_ratio_vs_quiet": _r(
                percentile([r["latency"] for r in thrash if r["ok"] and r["hit"]], 95)
                / percentile([r["latency"] for r in quiet if r["ok"] and r["hit"]], 95)
            )
            if any(r["ok"] and r["hit"] for r in thrash) and any(r["ok"] and r["hit"] for r in quiet)
            else None,
            "loads_per_min": per_minute("thrash", "loads"),
            "evictions_per_min": per_minute("thrash", "evictions"),
            "retry_after_ratio_median": _retry_after(thrash, revision_of, ready, intervals)["median"],
        },
        "loads_per_min": {k: per_minute(k, "loads") for k in ("quiet", "scan", "thrash", "recovery")},
        "evictions_per_min": {k: per_minute(k, "evictions") for k in ("quiet", "scan", "thrash", "recovery")},
        "load_slot": _load_slot(run.get("loads", []), windows),
        "gateway_counters": delta,
        "gateway_gpu_share_of_routed": _r(gpu_share),
        "loads_from_disk_share": _r(disk_share),
        "timeline": _timeline(records, run["started"], minutes),
        "windows": [
            {k: (round(v - run["started"], 1) if k in ("start", "end") else v) for k, v in w.items()} for w in windows
        ],
    }


def _timeline(records: list[dict], origin: float, minutes) -> dict:
    """Per 10 s from the streams' start: requests answered at once, served after a 503, failed; and per minute the
    node's loads and evictions."""
    buckets: dict[int, Counter] = {}
    for r in records:
        k = int((r["start"] - origin) // 10)
        outcome = "failed" if not r["ok"] else ("hit" if r["hit"] else "cold")
        buckets.setdefault(k, Counter())[outcome] += 1
    span = max(buckets) + 1 if buckets else 0
    return {
        "bucket_s": 10,
        "hit": [buckets.get(k, Counter())["hit"] for k in range(span)],
        "cold": [buckets.get(k, Counter())["cold"] for k in range(span)],
        "failed": [buckets.get(k, Counter())["failed"] for k in range(span)],
        "minute_t_s": [round(m - origin, 1) for m, _ in minutes],
        "loads": [row.get("loads", 0) for _, row in minutes],
        "evictions": [row.get("evictions", 0) for _, row in minutes],
    }


def stall_figures(stall: dict) -> dict:
    load, paging = stall.get("load", {}), stall.get("paging", {})
    return {
        "load_stall_p95_ms": load.get("p95_difference_ms_median"),
        "load_stall_p95_ratio_median": load.get("p95_ratio_median"),
        "load_stall_p95_ratio_ci95": load.get("p95_ratio_ci95"),
        "paging_stall_p95_ms": paging.get("p95_difference_ms_median"),
        "paging_stall_p95_ratio_median": paging.get("p95_ratio_median"),
        "paging_stall_p95_ratio_ci95": paging.get("p95_ratio_ci95"),
        "stall": stall,
    }
