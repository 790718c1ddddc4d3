"""Baselines replayed offline over a recorded sequence of requests: plain LRU and Belady's optimum.

Both answer, per request, whether it found its key cached, for one cache of `capacity` keys that must serve every
request (a miss loads the key). Belady's optimum (MIN, with bypass) knows the future: on a miss with the cache
full it drops whichever of the cached keys and the incoming one is asked for again furthest ahead (the incoming
one too: serving a request and unloading at once is allowed), which no online policy can beat.
`per_node` runs either over the requests each node received (the same routing for every policy compared).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


def lru_hits(keys: np.ndarray, capacity: int) -> np.ndarray:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(keys.size, dtype=bool)
    if capacity <= 0:
        return hits
    for i, key in enumerate(keys.tolist()):
        if key in cache:
            cache.move_to_end(key)
            hits[i] = True
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each position, the position of the same key's next request (len(keys) + 1 when there is none)."""
    n = keys.size
    order = np.lexsort((np.arange(n), keys))  # by key, then position
    nxt = np.full(n, n + 1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(keys: np.ndarray, capacity: int) -> np.ndarray:
    hits = np.zeros(keys.size, dtype=bool)
    if capacity <= 0:
        return hits
    nxt = next_use(keys).tolist()
    cached: dict[int, int] = {}  # key → its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), with stale entries skipped lazily
    for i, key in enumerate(keys.tolist()):
        due = nxt[i]
        if key in cached:
            hits[i] = True
            cached[key] = due
            heapq.heappush(heap, (-due, key))
            continue
        if len(cached) < capacity:
            cached[key] = due
            heapq.heappush(heap, (-due, key))
            continue
        while cached.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        furthest, victim = heap[0]
        if -furthest > due:
            heapq.heappop(heap)
            del cached[victim]
            cached[key] = due
            heapq.heappush(heap, (-due, key))
        if len(heap) > 8 * capacity + 1024:  # drop stale entries now and then
            heap = [(-d, k) for k, d in cached.items()]
            heapq.heapify(heap)
    return hits


def per_node(
    keys: np.ndarray, nodes: np.ndarray, capacity: int, replay: Callable[[np.ndarray, int], np.ndarray]
) -> np.ndarray:
    """`replay` over each node's own requests (in order), the answers put back in the requests' order."""
    hits = np.zeros(keys.size, dtype=bool)
    order = np.argsort(nodes, kind="stable")
    bounds = np.flatnonzero(np.diff(nodes[order])) + 1
    for chunk in np.split(order, bounds):
        if chunk.size:
            hits[chunk] = replay(keys[chunk], capacity)
    return hits
