"""benchmarks/long_tail: the offline baselines are right, the trace has what it promises, and the simulator's quick
run writes every `sim_*` key the issue names (its live part needs a vLLM engine: `make bench` runs it)."""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest

from benchmarks.long_tail.offline import belady_hits, lru_hits, next_use, per_node
from benchmarks.long_tail.trace import TraceShape, generate, zipf_sizes
from tests.benchmarks.test_quick import COMMON_KEYS, run_module

SIM_KEYS = {
    "sim_adapters",
    "sim_nodes",
    "sim_requests",
    "sim_hit_ratio",
    "sim_hit_ratio_lru",
    "sim_hit_ratio_belady",
    "sim_decisions_per_s",
}


def optimum(keys: list[int], capacity: int) -> int:
    """The most hits any policy can get (a miss loads the key, which may be dropped at once), by exhaustive search."""

    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(keys):
            return 0
        key = keys[i]
        if key in cached:
            return 1 + best(i + 1, cached)
        if len(cached) < capacity:
            return best(i + 1, cached | {key})
        keep_out = best(i + 1, cached)  # serve it and drop it
        swaps = max(best(i + 1, (cached - {victim}) | {key}) for victim in cached)
        return max(keep_out, swaps)

    return best(0, frozenset())


def test_lru_hits_follow_recency():
    assert lru_hits(np.array([1, 2, 1, 3, 2, 1]), 2).tolist() == [False, False, True, False, False, False]


def test_next_use_points_at_the_same_keys_next_request():
    assert next_use(np.array([5, 6, 5, 5, 7])).tolist() == [2, 6, 3, 6, 6]


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_optimum_and_lru_never_beats_it(seed):
    rng = random.Random(seed)
    keys = [rng.randrange(6) for _ in range(14)]
    capacity = rng.choice([1, 2, 3])
    hits = belady_hits(np.array(keys), capacity)
    assert int(hits.sum()) == optimum(keys, capacity)
    assert hits.sum() >= lru_hits(np.array(keys), capacity).sum()


def test_per_node_replays_each_nodes_requests_apart():
    keys, nodes = np.array([1, 1, 2, 1, 2, 2]), np.array([0, 1, 0, 0, 1, 1])
    # Node 0 sees 1, 2, 1 (capacity 1: no hit); node 1 sees 1, 2, 2 (one hit).
    assert per_node(keys, nodes, 1, lru_hits).tolist() == [False, False, False, False, False, True]


def test_trace_has_zipf_tenants_scans_of_cold_adapters_and_drift():
    shape = TraceShape(adapters=5_000, tenants=50, requests=60_000, epochs=6, scans=2, scan_size=500, drift_pool=500)
    trace = generate(shape)
    sizes = zipf_sizes(5_000, 50, 1.0)
    assert sizes.sum() == 5_000 and list(sizes) == sorted(sizes, reverse=True)
    assert trace.adapters.size == 60_000 and np.bincount(trace.tenant_of).tolist() == sizes.tolist()
    scanned = trace.adapters[trace.scan]
    assert scanned.size == 1_000 and np.unique(scanned).size == 1_000  # each once
    assert set(trace.tenant_of[scanned].tolist()) == set(trace.scan_tenants) == {0, 1}
    assert trace.scan_phase.sum() > 0 and not (trace.scan & trace.scan_phase).any()
    # The popular set drifts: the most asked-for adapters of the first and the last epoch differ.
    first, last = trace.adapters[:10_000], trace.adapters[-10_000:]
    top = [set(np.argsort(-np.bincount(part, minlength=5_000))[:50].tolist()) for part in (first, last)]
    assert len(top[0] & top[1]) < 50


def test_quick_simulation_writes_the_sim_keys_and_a_report_section(tmp_path):
    done = run_module("benchmarks.long_tail", "--quick", "--only", "sim", "--out", str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    body = json.loads((tmp_path / "long_tail.json").read_text())
    assert not (COMMON_KEYS | SIM_KEYS) - body.keys()
    assert body["sim_requests"] == 200_000 and body["sim_nodes"] == 10
    assert 0 < body["sim_hit_ratio_lru"] <= body["sim_hit_ratio_belady"] <= 1
    assert 0 < body["sim_hit_ratio"] <= body["sim_hit_ratio_belady"]
    assert body["sim_decisions_per_s"] > 0
    report = run_module("benchmarks.report", "--out", str(tmp_path), timeout=120)
    assert report.returncode == 0, report.stderr[-4000:]
    section = (tmp_path / "benchmarks.md").read_text().split("## Long tail: residency tiers", 1)[1].split("\n## ")[0]
    assert "simulator: policy decisions per second, one core (CPU time)" in section
    assert (tmp_path / "long_tail.png").stat().st_size > 0


def test_live_figures_follow_their_definitions():
    """A hand-made run: the thrashing phase is left out of the success ratio, a 503 whose revision was never ready
    again counts as Retry-After ratio 0, a cold start is a success whose first attempt got 503."""
    from benchmarks.long_tail.figures import live_figures

    def rec(kind, start, alias, latency, attempts, error=""):
        return {
            "kind": kind,
            "tenant": 0,
            "alias": alias,
            "start": start,
            "latency": latency,
            "error": error,
            "attempts": attempts,
        }

    ok = [(0.0, 0.0, 200, None, "")]
    windows = [
        {"kind": "quiet", "pair": 0, "start": 0.0, "end": 10.0, "tiers": {"loads": 1}},
        {"kind": "scan", "pair": 0, "start": 10.0, "end": 20.0, "tiers": {"loads": 2}},
        {"kind": "thrash", "pair": None, "start": 20.0, "end": 30.0, "tiers": {"loads": 0}},
    ]
    records = [
        rec("hot", 1.0, 0, 0.1, ok),
        rec("hot", 2.0, 0, 0.2, ok),
        rec("hot", 11.0, 0, 0.3, ok),
        # Cold: 503 saying 2 s at t=12, ready at t=13 (ratio 2), served on the retry.
        rec("zipf", 12.0, 1, 2.5, [(12.0, 12.0, 503, 2.0, "adapter_not_ready"), (14.0, 14.5, 200, None, "")]),
        # Failed in the thrashing phase: never ready again (ratio 0 each time).
        rec("thrash", 21.0, 2, 9.0, [(21.0, 21.0, 503, 3.0, "adapter_not_ready")] * 3, error="503 adapter_not_ready"),
    ]
    run = {
        "params": {"cpu_slots": 2},
        "windows": windows,
        "records": records,
        "revision_of": [100, 101, 102],
        "ready": {101: [13.0]},
        "ready_intervals": {101: [(13.0, 40.0)]},
        "tiers_before": {"bench": {}, "-": {}},
        "tiers_after": {"bench": {"gpu": 3, "cpu": 1, "loads": 4, "from_disk": 1}, "-": {"miss": 4}},
        "per_minute": [],
        "started": 0.0,
        "ended": 30.0,
        "live_aliases": 3,
        # Loads (started, ready): two overlapping in the quiet window, one across its end into the scan window.
        "loads": [(1.0, 2.0), (1.5, 3.0), (9.0, 11.0)],
    }
    figures = live_figures(run)
    assert figures["openai_success_ratio"] == 1.0  # the thrashing phase's failure is not in it
    assert figures["openai_success_ratio_with_thrashing"] == 0.8
    assert figures["cold_starts"] == 1 and figures["cold_start_p50_s"] == 2.5
    assert figures["retry_after"]["answers"] == 4 and figures["retry_after"]["never_ready"] == 3
    assert figures["retry_after_ratio_median"] == 0.0 and figures["retry_after"]["median_by_kind"]["zipf"] == 2.0
    assert figures["hot_pairs"][0]["ratio"] == pytest.approx(0.3 / 0.195, rel=1e-3)
    assert figures["thrash_phase"]["success_ratio"] == 0.0
    # The load slot held 1-3 s and 9-11 s: 3 s of the quiet window, 1 s of the scan window, none of the thrashing.
    slot = figures["load_slot"]
    assert slot["quiet"] == {"busy_share": 0.3, "loads": 2, "slot_s_median": 1.25}
    assert slot["scan"] == {"busy_share": 0.1, "loads": 1, "slot_s_median": 2.0}
    assert slot["thrash"] == {"busy_share": 0.0, "loads": 0, "slot_s_median": None}


def test_the_sustained_load_burst_takes_one_alias_of_each_tenant_in_turn():
    """One tenant's loads would measure its pacing (MINT_NODE_COLD_LOADS_PER_MIN), not the node."""
    from types import SimpleNamespace

    from benchmarks.long_tail.live import LiveParams, _burst

    sizes = {0: 5, 1: 4, 2: 3, 3: 2, 4: 1, 5: 2}  # tenant 0 scans, 1 is hot, 5 (the last) calibrates
    live = SimpleNamespace(aliases=[SimpleNamespace(tenant=t) for t, n in sizes.items() for _ in range(n)])
    params = LiveParams(tenants=6, cpu_slots=3)
    burst = _burst(live, params, {"scanner": 0, "hot_tenant": 1})
    assert [live.aliases[i].tenant for i in burst] == [4, 3, 2, 3, 2, 2]
    assert len(set(burst)) == len(burst)
