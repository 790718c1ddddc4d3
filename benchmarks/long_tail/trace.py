"""The simulator's synthetic trace: Zipf popularity over many adapters in Zipf-sized tenants, drifting, with scans.

- Adapters belong to tenants whose sizes follow Zipf (s = `tenant_s`): a few tenants own most adapters.
- Requests pick a popularity rank by Zipf (s = 1) over all adapters; a permutation maps ranks to adapters, so a
  tenant's adapters are spread over the ranks.
- The popular set drifts: the trace runs in `epochs`, and between two, `drift` of the ranks in the hottest
  `drift_pool` trade places with ranks drawn from the whole range (hot adapters go cold, cold ones hot).
- Scans: in `scans` of the epochs, one big tenant asks for up to `scan_size` of its coldest adapters once each,
  its requests mixed in among the others' over the first half of that epoch.

Everything is drawn with numpy from one seed: the same arguments give the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceShape:
    adapters: int
    tenants: int
    requests: int
    epochs: int = 20
    drift: float = 0.1  # share of the hottest `drift_pool` ranks that change places at each epoch
    drift_pool: int = 20_000
    scans: int = 4
    scan_size: int = 50_000
    tenant_s: float = 1.0
    popularity_s: float = 1.0
    seed: int = 28


@dataclass
class Trace:
    """Requests as adapter ids (int32), with each request's flags and each adapter's tenant."""

    adapters: np.ndarray  # adapter id per request
    tenant_of: np.ndarray  # tenant id per adapter
    scan: np.ndarray  # bool per request: a scan's request
    scan_phase: np.ndarray  # bool per request: another tenant's request while a scan runs
    scan_tenants: list[int]


def zipf_sizes(total: int, groups: int, s: float) -> np.ndarray:
    """`total` items in `groups` groups with Zipf (s) sizes, largest first, each at least 1."""
    weights = 1.0 / np.arange(1, groups + 1) ** s
    sizes = np.maximum(1, np.floor(total * weights / weights.sum()).astype(np.int64))
    sizes[0] += total - sizes.sum()  # rounding: the largest group takes the difference
    return sizes


def zipf_ranks(rng: np.random.Generator, n: int, count: int, s: float) -> np.ndarray:
    """`count` ranks in [0, n) drawn with probability ∝ 1 / (rank + 1)^s (inverse CDF: numpy's zipf needs s > 1
    and is unbounded)."""
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** s)
    cdf /= cdf[-1]
    return np.searchsorted(cdf, rng.random(count), side="right").astype(np.int32)


def generate(shape: TraceShape) -> Trace:
    rng = np.random.default_rng(shape.seed)
    sizes = zipf_sizes(shape.adapters, shape.tenants, shape.tenant_s)
    tenant_of = np.repeat(np.arange(shape.tenants, dtype=np.int32), sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    perm = rng.permutation(shape.adapters).astype(np.int32)  # rank → adapter
    scan_epochs = set(np.linspace(2, shape.epochs - 2, shape.scans).astype(int).tolist()) if shape.scans else set()
    scan_sizes = [min(shape.scan_size, int(sizes[i]), shape.requests // (4 * shape.epochs)) for i in range(shape.scans)]
    normal_total = shape.requests - sum(scan_sizes[: len(scan_epochs)])
    per_epoch = np.full(shape.epochs, normal_total // shape.epochs)
    per_epoch[: normal_total % shape.epochs] += 1
    pool = min(shape.drift_pool, shape.adapters)
    parts, scan_flags, phase_flags, scan_tenants = [], [], [], []
    for epoch in range(shape.epochs):
        if epoch:
            moved = rng.choice(pool, size=int(pool * shape.drift), replace=False)
            partners = rng.integers(0, shape.adapters, size=moved.size)
            for a, b in zip(moved.tolist(), partners.tolist(), strict=True):
                perm[a], perm[b] = perm[b], perm[a]
        requests = perm[zipf_ranks(rng, shape.adapters, int(per_epoch[epoch]), shape.popularity_s)]
        scan = np.zeros(requests.size, dtype=bool)
        phase = np.zeros(requests.size, dtype=bool)
        if epoch in scan_epochs:
            k = len(scan_tenants)
            tenant, size = k, scan_sizes[k]
            scan_tenants.append(tenant)
            # The tenant's coldest adapters now: the highest ranks among its own.
            rank_of = np.empty(shape.adapters, dtype=np.int64)
            rank_of[perm] = np.arange(shape.adapters)
            own = np.arange(starts[tenant], starts[tenant] + sizes[tenant])
            cold = own[np.argsort(-rank_of[own], kind="stable")[:size]].astype(np.int32)
            half = requests.size // 2
            mixed = np.concatenate((requests[:half], cold))
            flags = np.concatenate((np.zeros(half, dtype=bool), np.ones(size, dtype=bool)))
            order = rng.permutation(mixed.size)
            requests = np.concatenate((mixed[order], requests[half:]))
            scan = np.concatenate((flags[order], np.zeros(requests.size - mixed.size, dtype=bool)))
            phase = np.concatenate((~flags[order], np.zeros(requests.size - mixed.size, dtype=bool)))
        parts.append(requests)
        scan_flags.append(scan)
        phase_flags.append(phase)
    return Trace(
        adapters=np.concatenate(parts),
        tenant_of=tenant_of,
        scan=np.concatenate(scan_flags),
        scan_phase=np.concatenate(phase_flags),
        scan_tenants=scan_tenants,
    )
