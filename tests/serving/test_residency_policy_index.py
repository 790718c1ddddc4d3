"""NodeCache's per-tenant view of its segments (kept so that a tenant over its share finds its own victim without
walking every entry) always equals the segments filtered by tenant, in the same order, whatever happens."""

from __future__ import annotations

import random

import pytest

from serving.residency.policy import NodeCache, Segment, Shape


def assert_views_match(cache: NodeCache) -> None:
    segments = {Segment.WINDOW: cache.window, Segment.PROBATION: cache.probation, Segment.PROTECTED: cache.protected}
    tenants = {cache.tenant_of(key) for entries in segments.values() for key in entries}
    assert set(cache._own) == tenants
    for tenant in tenants:
        for segment, entries in segments.items():
            mine = [key for key in entries if cache.tenant_of(key) == tenant]
            assert list(cache._own[tenant].get(segment, ())) == mine, (tenant, segment)
    assert sum(cache.owned.values()) == len(cache)


@pytest.mark.parametrize("seed", range(4))
def test_tenant_views_follow_hits_misses_evictions_shrinks_and_rebuilds(seed):
    rng = random.Random(seed)
    cache: NodeCache[int] = NodeCache(12, Shape(window=0.25, protected=0.75))
    counts: dict[int, int] = {}
    for step in range(3000):
        key = rng.randrange(80)
        counts[key] = counts.get(key, 0) + 1
        if key in cache:
            cache.hit(key)
        else:
            busy = set(rng.sample(sorted(k for k in range(80) if k in cache), k=min(len(cache), rng.randrange(4))))
            cache.miss(key, key % 5, frequency=lambda k: counts.get(k, 0), busy=busy)
        if step % 97 == 0 and len(cache):
            cache.remove(rng.choice([k for k in range(80) if k in cache]))
        if step % 211 == 0:
            cache.capacity = rng.randrange(4, 16)  # a pin takes a slot, or gives it back
            cache.shrink(frequency=lambda k: counts.get(k, 0))
            cache.rebalance()
        if step % 301 == 0:
            cache.add(rng.randrange(80), rng.randrange(5), rng.choice(list(Segment)))  # rebuilt from stored state
        assert_views_match(cache)
