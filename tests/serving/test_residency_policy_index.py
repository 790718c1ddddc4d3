"""NodeCache's share rule holds whatever happens: a tenant at its cap never evicts another tenant's recurring
entry, and the per-tenant counts always equal the segments' entries by tenant."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from serving.residency.policy import ONE_OFF, NodeCache, Segment, Shape


def assert_counts_match(cache: NodeCache) -> None:
    entries = [key for segment in (cache.window, cache.probation, cache.protected) for key in segment]
    assert Counter(cache.tenant_of(key) for key in entries) == cache.owned
    assert len(entries) == len(cache)


@pytest.mark.parametrize("seed", range(4))
def test_no_tenant_loses_a_recurring_entry_to_one_at_its_cap(seed):
    rng = random.Random(seed)
    cache: NodeCache[int] = NodeCache(12, Shape(window=0.25, protected=0.75, tenant=0.25))
    counts: dict[int, int] = {}
    checked = 0
    for step in range(3000):
        key = rng.randrange(80)
        tenant = key % 5
        counts[key] = counts.get(key, 0) + 1
        if key in cache:
            cache.hit(key)
        else:
            busy = set(rng.sample(sorted(k for k in range(80) if k in cache), k=min(len(cache), rng.randrange(4))))
            owned, tenants = dict(cache.owned), len(cache.owned) + (tenant not in cache.owned)
            holds = owned.get(tenant, 0)
            # Full, not over (a fallen capacity is shrunk back first, by frequency alone).
            full = len(cache) == cache.capacity and len(cache.window) <= cache.window_size()
            evicted = cache.miss(key, tenant, frequency=lambda k: counts.get(k, 0), busy=busy).evicted
            if full and holds and tenants > 1 and holds + 1 > max(cache.capacity * 0.25, cache.capacity / tenants):
                for gone in evicted:
                    gone_tenant = gone % 5
                    one_off = counts.get(gone, 0) <= ONE_OFF
                    assert gone_tenant == tenant or one_off, gone
                    checked += 1
        if step % 97 == 0 and len(cache):
            cache.remove(rng.choice([k for k in range(80) if k in cache]))
        if step % 211 == 0:
            cache.capacity = rng.randrange(4, 16)  # a pin takes a slot, or gives it back
            cache.shrink(frequency=lambda k: counts.get(k, 0))
            cache.rebalance()
        if step % 301 == 0:
            added = rng.randrange(80)
            cache.add(added, added % 5, rng.choice(list(Segment)))  # rebuilt from stored state
        assert_counts_match(cache)
    assert checked > 100  # the rule was exercised, not just vacuously true
