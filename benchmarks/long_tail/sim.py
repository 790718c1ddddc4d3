"""The trace-driven simulator: the serving plane's placement and eviction code over a synthetic trace, no engine.

The same objects the control plane runs (serving/residency/: `NodeCache`, `choose_node`, `LocalCounts`), one
`NodeCache` per node holding its on-demand slots, driven the way serving/services/residency.py drives them: a
request for a revision resident on a node is a hit there (`hit`); otherwise `choose_node` picks where it loads
(the first node of its preference order with a free slot, else one of its best nodes holding its files on disk,
else its home) and that node's cache takes it in (`miss`, which names what leaves). Frequencies are shared by
every node (as Redis shares them between processes), aged in two rolling periods of ten times the fleet's slots
in requests (TinyLFU's sample size).

Not modelled: requests in flight (`busy`: no entry is protected by a request using it) and pinned revisions
(every slot is on demand). The disk tier is a plain LRU of `disk_slots` revisions per node.

Preference order: rendezvous hashing (serving/services/rendezvous.py) scores every node for a revision and takes
the best first. Hashing 10^6 revisions by 100 nodes with BLAKE2b in Python takes minutes, so here every pair is
scored at once with numpy by a 64-bit mix (splitmix64's finalizer) of the revision's and the node's ids, equal
weights (equal slots), and each revision keeps its best `keep` nodes: the same rule with another hash. Past those
`keep`, the real order only matters while nodes still have free slots (the first seconds of a trace).

Plain LRU runs through the same driver (`LruCache`: one LRU per node, same routing rule, no window, no
frequencies, no tenant cap); Belady's optimum replays, per node, the requests the policy routed there.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from benchmarks.long_tail.trace import Trace
from serving.residency.frequency import LocalCounts
from serving.residency.policy import Admission, NodeCache, Shape, choose_node

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def preferences(adapters: int, nodes: int, keep: int, *, chunk: int = 20_000) -> np.ndarray:
    """Each revision's `keep` best nodes by rendezvous score (a 64-bit mix of both ids), best first."""
    keep = min(keep, nodes)
    node_keys = _mix(np.arange(1, nodes + 1, dtype=np.uint64) * _GOLDEN)
    out = np.empty((adapters, keep), dtype=np.int16)
    with np.errstate(over="ignore"):
        for start in range(0, adapters, chunk):
            ids = np.arange(start, min(start + chunk, adapters), dtype=np.uint64)
            scores = _mix(_mix(ids * _GOLDEN + np.uint64(1))[:, None] ^ node_keys[None, :])
            best = np.argpartition(-scores.astype(np.float64), keep - 1, axis=1)[:, :keep]
            ranked = np.take_along_axis(scores, best, axis=1)
            out[start : start + ids.size] = np.take_along_axis(best, np.argsort(-ranked.astype(np.float64)), axis=1)
    return out


class LruCache:
    """Plain LRU with NodeCache's interface, for the baseline run."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def free(self) -> int:
        return max(0, self.capacity - len(self.entries))

    def hit(self, key: int) -> None:
        self.entries.move_to_end(key)

    def miss(self, key: int, tenant: int, *, frequency, busy=()) -> Admission[int]:
        evicted = []
        if len(self.entries) >= self.capacity:
            evicted.append(self.entries.popitem(last=False)[0])
        self.entries[key] = None
        return Admission(True, evicted)


@dataclass(frozen=True)
class Fleet:
    nodes: int
    slots: int  # on-demand slots per node (its CPU tier)
    disk_slots: int  # revisions whose files a node keeps on disk
    keep: int = 4  # preference order kept per revision
    disk_choices: int = 3  # MINT_RESIDENCY_DISK_CHOICES


@dataclass
class Run:
    hits: np.ndarray  # bool per request: found resident
    nodes: np.ndarray  # node per request: where it was served (or loaded)
    from_disk: int  # misses loaded from a node's disk
    not_admitted: int
    evictions: int
    cpu_s: float  # CPU time of the decisions (this thread)
    wall_s: float


def run(trace: Trace, prefs: np.ndarray, fleet: Fleet, make_cache, *, chunk: int = 1_000_000) -> Run:
    """Drive `make_cache()` (one per node) with every request of the trace; see the module docstring."""
    caches = [make_cache() for _ in range(fleet.nodes)]
    disks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(fleet.nodes)]
    where: dict[int, int] = {}
    period = 10 * fleet.nodes * fleet.slots
    counts = LocalCounts(period)
    record, estimate = counts.record, counts.estimate
    tenant_of = trace.tenant_of.tolist()
    total = trace.adapters.size
    hits = bytearray(total)
    nodes = array("h", bytes(2 * total))
    from_disk = not_admitted = evictions = 0
    disk_slots, disk_choices = fleet.disk_slots, fleet.disk_choices

    # Free slots per node, kept up to date after each miss: choose_node asks up to `keep` nodes a miss, and a list
    # lookup answers without a Python call (NodeCache.free() would be one per node asked).
    room = [fleet.slots] * fleet.nodes
    free = room.__getitem__
    orders = prefs.tolist()  # each revision's nodes as a Python list, made once (a numpy row per miss costs more)
    asked = [0]  # the revision of the miss being decided, for on_disk

    def on_disk(node: int) -> bool:
        return asked[0] in disks[node]

    cpu0, wall0 = time.thread_time(), time.perf_counter()
    i, due = 0, period
    for start in range(0, total, chunk):
        for key in trace.adapters[start : start + chunk].tolist():
            if i == due:
                counts.advance(i)
                due += period
            record(key)
            node = where.get(key)
            if node is not None:
                caches[node].hit(key)
                hits[i] = 1
                nodes[i] = node
                i += 1
                continue
            asked[0] = key
            node = choose_node(orders[key], free=free, on_disk=on_disk, disk_choices=disk_choices)
            cache = caches[node]
            admission = cache.miss(key, tenant_of[key], frequency=estimate)
            room[node] = cache.capacity - len(cache)
            for gone in admission.evicted:
                del where[gone]
            evictions += len(admission.evicted)
            if admission.admitted:
                where[key] = node
            else:
                not_admitted += 1
            disk = disks[node]
            if key in disk:
                disk.move_to_end(key)
                from_disk += 1
            else:
                disk[key] = None
                if len(disk) > disk_slots:
                    disk.popitem(last=False)
            nodes[i] = node
            i += 1
    cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
    return Run(
        hits=np.frombuffer(bytes(hits), dtype=np.uint8).astype(bool),
        nodes=np.frombuffer(nodes, dtype=np.int16).copy(),
        from_disk=from_disk,
        not_admitted=not_admitted,
        evictions=evictions,
        cpu_s=cpu_s,
        wall_s=wall_s,
    )


def policy_cache(slots: int, shape: Shape | None = None):
    return lambda: NodeCache(slots, shape or Shape())


def lru_cache(slots: int):
    return lambda: LruCache(slots)


def simulate(shape, fleet: Fleet, say) -> dict:
    """Generate the trace, run the policy and plain LRU through it, replay Belady; the `sim_*` figures."""
    from benchmarks.long_tail.offline import belady_hits, lru_hits, per_node
    from benchmarks.long_tail.trace import generate

    took: dict[str, float] = {}
    started = time.perf_counter()
    trace = generate(shape)
    prefs = preferences(shape.adapters, fleet.nodes, fleet.keep)
    took["trace_s"] = time.perf_counter() - started
    say(f"sim: trace of {trace.adapters.size:,} requests over {shape.adapters:,} adapters ({took['trace_s']:.0f} s)")
    policy = run(trace, prefs, fleet, policy_cache(fleet.slots))
    say(f"sim: policy {policy.hits.mean():.4f} hit ratio, {trace.adapters.size / policy.cpu_s:,.0f} decisions/s")
    lru = run(trace, prefs, fleet, lru_cache(fleet.slots))
    say(f"sim: LRU {lru.hits.mean():.4f}")
    # The policy again with every adapter in one tenant: W-TinyLFU without the tenant cap.
    alone = run(
        Trace(trace.adapters, np.zeros_like(trace.tenant_of), trace.scan, trace.scan_phase, trace.scan_tenants),
        prefs,
        fleet,
        policy_cache(fleet.slots),
    )
    say(f"sim: policy without the tenant cap {alone.hits.mean():.4f}")
    started = time.perf_counter()
    belady = per_node(trace.adapters, policy.nodes, fleet.slots, belady_hits)
    lru_same = per_node(trace.adapters, policy.nodes, fleet.slots, lru_hits)
    took["replays_s"] = time.perf_counter() - started
    say(f"sim: Belady {belady.mean():.4f} (same routing as the policy)")

    def ratio(hits: np.ndarray, where: np.ndarray | None = None) -> float | None:
        chosen = hits if where is None else hits[where]
        return round(float(chosen.mean()), 4) if chosen.size else None

    n = trace.adapters.size
    return {
        "sim_adapters": shape.adapters,
        "sim_tenants": shape.tenants,
        "sim_nodes": fleet.nodes,
        "sim_requests": int(n),
        "sim_slots_per_node": fleet.slots,
        "sim_disk_slots_per_node": fleet.disk_slots,
        "sim_hit_ratio": ratio(policy.hits),
        "sim_hit_ratio_lru": ratio(lru.hits),
        "sim_hit_ratio_belady": ratio(belady),
        "sim_hit_ratio_lru_same_routing": ratio(lru_same),
        "sim_hit_ratio_without_tenant_shares": ratio(alone.hits),
        # Other tenants' requests while a scan runs (the scan's own are cold for every policy).
        "sim_scan_phase": {
            "hit_ratio": ratio(policy.hits, trace.scan_phase),
            "hit_ratio_lru": ratio(lru.hits, trace.scan_phase),
            "hit_ratio_belady": ratio(belady, trace.scan_phase),
            "hit_ratio_without_tenant_shares": ratio(alone.hits, trace.scan_phase),
            "scan_requests": int(trace.scan.sum()),
            "scanning_tenants": trace.scan_tenants,
        },
        "sim_decisions_per_s": round(n / policy.cpu_s),
        "sim_decisions_per_s_wall": round(n / policy.wall_s),
        "sim_decisions_per_s_without_tenant_shares": round(n / alone.cpu_s),
        "sim_misses": int(n - policy.hits.sum()),
        "sim_miss_decisions_per_s": round((n - int(policy.hits.sum())) / policy.cpu_s),
        "sim_loads_from_disk_share": round(policy.from_disk / max(1, n - int(policy.hits.sum())), 4),
        "sim_not_admitted": policy.not_admitted,
        "sim_evictions": policy.evictions,
        "sim_cpu_s": {"policy": round(policy.cpu_s, 1), "lru": round(lru.cpu_s, 1), "alone": round(alone.cpu_s, 1)},
        "sim_wall_s": {
            "policy": round(policy.wall_s, 1),
            "lru": round(lru.wall_s, 1),
            "alone": round(alone.wall_s, 1),
            **{k: round(v, 1) for k, v in took.items()},
        },
        "sim_shape": {
            "epochs": shape.epochs,
            "drift": shape.drift,
            "drift_pool": shape.drift_pool,
            "scans": shape.scans,
            "scan_size": shape.scan_size,
            "tenant_zipf_s": shape.tenant_s,
            "popularity_zipf_s": shape.popularity_s,
            "preference_nodes_kept": fleet.keep,
            "frequency_period_requests": 10 * fleet.nodes * fleet.slots,
        },
    }
