"""The residency policy as a pure object (serving/residency/): W-TinyLFU segments, tenant caps, busy entries,
where a miss loads, and the frequency's aging. No database: the simulator runs the same code."""

from __future__ import annotations

import random

from serving.residency.frequency import LocalCounts
from serving.residency.policy import ONE_OFF, NodeCache, Segment, Shape, choose_node


def replay(cache: NodeCache, freq: LocalCounts, trace: list[tuple[int, int]], start: int = 0) -> tuple[int, int]:
    """(hits, misses) of a trace of (tenant, key) through `cache`, its clock (requests) from `start`."""
    hits = misses = 0
    for clock, (tenant, key) in enumerate(trace, start):
        freq.advance(clock)
        freq.record(key)
        if key in cache:
            cache.hit(key)
            hits += 1
        else:
            assert cache.miss(key, tenant, frequency=freq.estimate).admitted
            misses += 1
    return hits, misses


def test_a_miss_takes_a_free_slot_without_evicting():
    cache: NodeCache[int] = NodeCache(4)
    assert cache.miss(1, tenant=1, frequency=lambda k: 0).evicted == []
    assert 1 in cache and cache.segment_of(1) == Segment.WINDOW and cache.free() == 3


def test_the_window_overflow_moves_to_probation_and_a_hit_there_protects():
    cache: NodeCache[int] = NodeCache(5, Shape(window=0.2))  # window 1, main 4 (protected 3)
    for key in (1, 2, 3):
        cache.miss(key, tenant=1, frequency=lambda k: 0)
    assert cache.segment_of(3) == Segment.WINDOW
    assert cache.segment_of(1) == cache.segment_of(2) == Segment.PROBATION
    assert cache.hit(1) == [(1, Segment.PROTECTED)]
    assert cache.segment_of(1) == Segment.PROTECTED


def test_protected_overflow_is_demoted_to_probation():
    cache: NodeCache[int] = NodeCache(5, Shape(window=0.2, protected=0.5))  # protected 2
    for key in (1, 2, 3, 4):
        cache.miss(key, tenant=1, frequency=lambda k: 0)
    for key in (1, 2, 3):
        cache.hit(key)
    assert cache.segment_of(1) == Segment.PROBATION  # pushed out of protected by 3
    assert {cache.segment_of(2), cache.segment_of(3)} == {Segment.PROTECTED}


def test_the_window_candidate_enters_main_only_if_asked_more_often_than_mains_victim():
    cache: NodeCache[int] = NodeCache(3, Shape(window=0.34))  # window 1, main 2
    counts = {1: 10, 2: 10, 3: 1, 4: 1}
    for key in (1, 2, 3):
        cache.miss(key, tenant=1, frequency=counts.__getitem__)
    # 4 comes in: 3 (window overflow, asked once) loses against main's victim 1 (asked 10 times).
    assert cache.miss(4, tenant=1, frequency=counts.__getitem__).evicted == [3]
    counts[4] = 50
    cache.miss(5, tenant=1, frequency=lambda k: counts.get(k, 0))
    assert 4 in cache and 1 not in cache  # 4 was asked more often than 1: 1 leaves


def test_a_scan_by_one_tenant_leaves_anothers_hot_set_in_place():
    rng = random.Random(5)
    hot = [(1, k) for k in range(6)]
    warm = [rng.choice(hot) for _ in range(400)]
    scan = [(2, 1000 + k) for k in range(300)]
    mixed = []
    for i, item in enumerate(scan):  # the hot tenant keeps asking while the other scans
        mixed.append(item)
        if i % 2 == 0:
            mixed.append(hot[(i // 2) % len(hot)])
    cache: NodeCache[int] = NodeCache(8)
    freq = LocalCounts(period=200)
    replay(cache, freq, warm)
    hits, _ = replay(cache, freq, mixed, start=len(warm))
    hot_hits = sum(1 for t, _ in mixed if t == 1)
    assert all(k in cache for _, k in hot)
    assert hits == hot_hits  # every hot request was a hit during the scan

    lru = NodeCache(8, Shape(window=1.0))  # a window as large as the cache: plain LRU
    replay(lru, LocalCounts(period=200), warm)
    lru_hits, _ = replay(lru, LocalCounts(period=200), mixed, start=len(warm))
    assert lru_hits < hits


def test_a_tenant_over_its_share_makes_room_from_its_own_entries():
    cache: NodeCache[int] = NodeCache(4)
    often = lambda key: 100 if key >= 100 else 2  # noqa: E731
    for key in (1, 2):
        cache.miss(key, tenant=1, frequency=often)
    for key in (100, 101):
        cache.miss(key, tenant=2, frequency=often)
    # Tenant 2's keys are asked for far more often, but it holds its share (2 of 4): its own entry leaves.
    evicted = cache.miss(102, tenant=2, frequency=often).evicted
    assert len(evicted) == 1 and cache.tenant_of(evicted[0]) is None and evicted[0] in (100, 101)
    assert 1 in cache and 2 in cache


def test_busy_entries_are_never_victims_and_a_miss_with_no_room_waits():
    cache: NodeCache[int] = NodeCache(2)
    cache.miss(1, tenant=1, frequency=lambda k: 0)
    cache.miss(2, tenant=1, frequency=lambda k: 0)
    assert cache.miss(3, tenant=1, frequency=lambda k: 0, busy={1}).evicted == [2]
    refused = cache.miss(4, tenant=1, frequency=lambda k: 0, busy={1, 3})
    assert not refused.admitted and refused.evicted == []  # nothing evictable: it waits, nothing changed
    assert 4 not in cache and {1, 3} == {k for k in (1, 2, 3, 4) if k in cache}
    assert cache.miss(4, tenant=1, frequency=lambda k: 0, busy={1}).admitted  # a slot frees later


def test_a_tenant_without_entries_gets_a_slot_even_with_many_tenants():
    cache: NodeCache[int] = NodeCache(2)
    cache.miss(1, tenant=1, frequency=lambda k: 0)
    cache.miss(2, tenant=2, frequency=lambda k: 0)
    outcome = cache.miss(3, tenant=3, frequency=lambda k: 0)
    assert outcome.admitted and len(outcome.evicted) == 1 and 3 in cache
    # Below their caps (one of two slots), frequency alone decides. Tenant 3's entry, the
    # window's overflow, is asked for less often than main's victim (tenant 1's): it leaves, not tenant 1's.
    asked = {1: 5}
    assert cache.miss(4, tenant=3, frequency=lambda k: asked.get(k, 0)).evicted == [3]
    assert 1 in cache


def test_a_tenant_at_its_cap_never_takes_anothers_recurring_entry_even_with_its_window_busy():
    cache: NodeCache[int] = NodeCache(6, Shape(tenant=0.25))  # the cap: an equal share (2 of 6), more than 1.5
    for key, tenant in ((1, 1), (2, 2), (3, 2), (4, 2), (5, 3), (6, 3)):
        cache.miss(key, tenant=tenant, frequency=lambda k: 0)
    asked = {1: 2, 2: 2, 3: 9, 4: 9, 5: 9, 6: 9}  # tenants 1's and 2's entries are recurring, and the coldest
    # Tenant 3 (at its cap) scans: its window entry is busy loading, so the victim comes from main, and only its
    # own entries may leave, not tenant 1's or 2's (however cold).
    evicted = cache.miss(7, tenant=3, frequency=lambda k: asked.get(k, 0), busy={6}).evicted
    assert evicted == [5] and all(k in cache for k in (1, 2, 3, 4))
    # Tenant 1, below its cap, takes the best victim of all.
    assert cache.miss(9, tenant=1, frequency=lambda k: asked.get(k, 0)).admitted and 1 in cache


def test_below_its_cap_a_busy_tenant_keeps_its_hot_set_against_many_tenants_rarely_used_entries():
    # 16 slots, 12 tenants with one adapter each asked for twice lately, and a hot tenant's 3 adapters asked for
    # a hundred times: an equal share (16 / 13) would make the hot tenant evict its own to load its fourth.
    cache: NodeCache[int] = NodeCache(16)
    asked = {key: 2 for key in range(12)} | {100: 100, 101: 100, 102: 100, 103: 100}
    for key in range(12):
        cache.miss(key, tenant=key, frequency=lambda k: 0)
    for key in (100, 101, 102):
        cache.miss(key, tenant=99, frequency=lambda k: 0)
    for key in (100, 101, 102):
        cache.hit(key)
    cache.miss(200, tenant=50, frequency=lambda k: 0)  # full
    evicted = cache.miss(103, tenant=99, frequency=lambda k: asked.get(k, 0)).evicted
    assert len(evicted) == 1 and evicted[0] not in (100, 101, 102)
    assert all(k in cache for k in (100, 101, 102, 103))


def test_a_first_request_waits_rather_than_push_out_mains_victim_unweighed_while_the_window_is_busy():
    cache: NodeCache[int] = NodeCache(5)  # window 1, main 4
    for key in range(4):
        cache.miss(key, tenant=key, frequency=lambda k: 0)
    cache.miss(10, tenant=9, frequency=lambda k: 0)  # full; 10 in the window
    asked = dict.fromkeys(range(4), 3) | {10: 1, 11: 1}
    # Tenant 9 asks for another adapter while its first is still answering: a scan's concurrent first requests.
    waits = cache.miss(11, tenant=9, frequency=lambda k: asked.get(k, 0), busy={10})
    assert not waits.admitted and waits.evicted == [] and all(k in cache for k in range(4))
    # Asked for more often than main's victim, it is taken in without waiting.
    asked[11] = 5
    taken = cache.miss(11, tenant=9, frequency=lambda k: asked.get(k, 0), busy={10})
    assert taken.admitted and taken.evicted == [0]


def test_a_busy_window_entry_asked_more_than_mains_victim_moves_to_main_and_lets_the_newcomer_in():
    cache: NodeCache[int] = NodeCache(5)  # window 1, main 4
    for key in range(4):
        cache.miss(key, tenant=1, frequency=lambda k: 0)
    cache.miss(10, tenant=2, frequency=lambda k: 0)  # full; 10 in the window
    asked = dict.fromkeys(range(4), 40) | {10: 10_000, 11: 1}
    # 10 answers all the time (busy at every decision): it still competes for main, and beats main's victim.
    taken = cache.miss(11, tenant=3, frequency=lambda k: asked.get(k, 0), busy={10})
    assert taken.admitted and taken.evicted == [0]
    assert cache.segment_of(10) == Segment.PROBATION and cache.segment_of(11) == Segment.WINDOW
    # Asked for less often than main's victim, it stays where it is, and a one-off newcomer waits.
    asked |= {10: 1, 12: 1}
    cache.add(10, 2, Segment.WINDOW)
    cache.remove(11)
    cache.add(11, 3, Segment.PROBATION)
    waits = cache.miss(12, tenant=3, frequency=lambda k: asked.get(k, 0), busy={10})
    assert not waits.admitted and waits.evicted == [] and cache.segment_of(10) == Segment.WINDOW


def test_a_load_under_way_in_the_window_does_not_let_an_idle_window_entry_into_main_unweighed():
    cache: NodeCache[str] = NodeCache(5)  # window 1, main 4
    for key in ("a1", "a2", "a3"):
        cache.add(key, 1, Segment.PROBATION)
    cache.add("w", 1, Segment.WINDOW)  # asked for once, idle
    cache.add("loading", 1, Segment.WINDOW)  # a load under way: busy, the window's newest
    asked = {"a1": 5, "a2": 5, "a3": 5, "w": 1, "loading": 1, "new": 1}
    taken = cache.miss("new", 1, frequency=asked.__getitem__, busy={"loading"})
    assert taken.admitted and taken.evicted == ["w"]
    assert [cache.segment_of(k) for k in ("a1", "a2", "a3")] == [Segment.PROBATION] * 3


def test_a_one_off_entry_holds_no_claim_to_its_tenants_share():
    cache: NodeCache[int] = NodeCache(6)
    for key, tenant in ((1, 1), (2, 2), (3, 2), (4, 2), (5, 3), (6, 3)):
        cache.miss(key, tenant=tenant, frequency=lambda k: 0)
    asked = {1: ONE_OFF, 2: 9, 3: 9, 4: 9, 5: 9, 6: 9}  # tenant 1 asked for its entry once: a one-off
    assert cache.miss(7, tenant=3, frequency=lambda k: asked.get(k, 0)).evicted == [1]


def test_a_tenant_over_its_share_with_only_busy_entries_waits():
    cache: NodeCache[int] = NodeCache(3)
    for key, tenant in ((1, 1), (2, 2), (3, 2)):
        cache.miss(key, tenant=tenant, frequency=lambda k: 0)
    refused = cache.miss(4, tenant=2, frequency=lambda k: 2, busy={2, 3})
    assert not refused.admitted and 1 in cache  # never tenant 1's entry (asked for more than once)


def test_a_miss_loads_on_the_first_node_with_room_else_where_its_files_are_else_home():
    free = {"a": 0, "b": 0, "c": 1}
    assert choose_node(["a", "b", "c"], free=free.__getitem__) == "c"
    free["c"] = 0
    assert choose_node(["a", "b", "c"], free=free.__getitem__, on_disk=lambda n: n == "b") == "b"
    assert choose_node(["a", "b", "c"], free=free.__getitem__) == "a"
    assert choose_node([], free=free.__getitem__) is None


def test_frequency_forgets_what_was_asked_two_periods_ago():
    freq = LocalCounts(period=10)
    freq.record("x", 3)
    freq.advance(12)
    freq.record("x")
    assert freq.estimate("x") == 4  # this period and the previous
    freq.advance(25)
    assert freq.estimate("x") == 1
    freq.advance(60)  # several periods later: nothing left
    assert freq.estimate("x") == 0
