"""Reads about residency: when a revision loading on demand should be ready, where each revision is resident.

`expected_ready_s` is what the gateway's 503 `Retry-After` says: the node's loads ahead of it (its place in the
admission queue) times the node's measured load time (fetch + load + warm-up of its recent placements), plus
what it waits for: a pacing pause, or room (for a request refused for want of it: serving/residency/room.py).
"""

from __future__ import annotations

import statistics
import time
from datetime import datetime
from functools import cache

from django.conf import settings
from django.utils import timezone

from serving.models import ColdStart, NodeCopy, Placement, PlacementState, PrewarmTurn
from serving.residency import stats

P = PlacementState
DEFAULT_LOAD_S = 1.0  # a node that never loaded anything: a guess, replaced by measurements after its first load
ROOM_PREFIX = "mint:residency:room"  # revision id → when a cold request refused for want of room should find it
_SAMPLE = 20


@cache
def _redis_for(url: str):
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)


def redis_client():
    """A Redis client for the residency counters (one connection pool per process and URL)."""
    return _redis_for(settings.REDIS_URL)


def node_series(node_names: list[str], *, minutes: int = 60) -> dict[str, dict]:
    """Per node (and `-`, requests for revisions loaded nowhere), the last `minutes` minutes as charts read them:
    `x` (minute starts, Unix seconds) and one list per measure: loads, cold (loads on demand), evictions,
    from_disk, requests served from the GPU batch and from the CPU tier as shares of the node's requests (null
    in a minute without any), and misses. Empty when Redis cannot be read."""
    import redis

    try:
        rows = stats.series(redis_client(), [*node_names, stats.FLEET], minutes=minutes)
    except redis.RedisError:
        return {}
    charts = {}
    for node, points in rows.items():
        served = [p.get("gpu", 0) + p.get("cpu", 0) for _, p in points]
        charts[node] = {
            "x": [start for start, _ in points],
            "bucket_s": 60,
            "per": "minute",
            "label": f"the last {minutes} minutes",
            **{f: [p.get(f, 0) for _, p in points] for f in ("loads", "cold", "evictions", "from_disk", "miss")},
            "gpu_share": [
                round(p.get("gpu", 0) / n, 3) if n else None for (_, p), n in zip(points, served, strict=True)
            ],
            "cpu_share": [
                round(p.get("cpu", 0) / n, 3) if n else None for (_, p), n in zip(points, served, strict=True)
            ],
            "served": served,
        }
    return charts


def node_load_s(node_id: int) -> float:
    """The median seconds of the node's recent loads (fetch, load and warm-up), or DEFAULT_LOAD_S."""
    rows = (
        Placement.objects.filter(node_id=node_id, load_ms__isnull=False, warm_ms__isnull=False)
        .order_by("-ready_at")
        .values_list("load_ms", "warm_ms")[:_SAMPLE]
    )
    times = [(load + warm) / 1000 for load, warm in rows]
    return statistics.median(times) if times else DEFAULT_LOAD_S


def node_cold_s(node_id: int, node_name: str, *, load_s: float | None = None) -> float:
    """The median seconds of the node's recent loads on demand, from the request that asked to ready: the load
    itself and everything around it (the victim's unload, the task hand-offs, admission). Without any yet, the
    node's load time (`load_s` when the caller has it already)."""
    rows = list(
        ColdStart.objects.filter(node=node_name).order_by("-asked_at").values_list("seconds", flat=True)[:_SAMPLE]
    )
    if rows:
        return statistics.median(rows)
    return node_load_s(node_id) if load_s is None else load_s


def cold_load_interval_s() -> float:
    """The least time between the starts of one tenant's loads on demand on a node that others use
    (MINT_NODE_COLD_LOADS_PER_MIN; 0 without that bound)."""
    per_min = settings.MINT_NODE_COLD_LOADS_PER_MIN
    return 60.0 / per_min if per_min else 0.0


def expected_ready_s(revision_id: int, *, now: datetime | None = None) -> float:
    """Seconds until the revision should be ready somewhere: 0 when it is; its fastest placement's estimate."""
    now = now or timezone.now()
    rows = list(
        Placement.objects.filter(revision_id=revision_id)
        .exclude(state__in=(P.EVICTING, P.FAILED))
        .values_list(
            "node__name", "node_id", "state", "started_at", "priority", "queued_at", "revision__adapter__tenant_id"
        )
    )
    if any(state == P.READY for _, _, state, *_ in rows):
        return 0.0
    estimates = []
    for node_name, node_id, state, started_at, priority, queued_at, tenant_id in rows:
        load_s = node_load_s(node_id)
        if state in (P.LOADING, P.WARMING):
            elapsed = (now - started_at).total_seconds() if started_at else 0.0
            estimates.append(max(0.1, load_s - elapsed))
        elif state == P.QUEUED:
            pauses = node_pauses(node_id, now)
            resting = {tenant for tenant, left in pauses.items() if left > 0 and tenant != tenant_id}
            ahead = (  # another tenant's loads resting for its pause do not go first
                Placement.objects.filter(node_id=node_id, state=P.QUEUED, priority__gte=priority)
                .filter(queued_at__lt=queued_at)
                .exclude(revision__adapter__tenant_id__in=resting)
                .count()
            )
            loading = Placement.objects.filter(node_id=node_id, state__in=(P.LOADING, P.WARMING)).count()
            turns = (ahead + loading) / max(1, settings.MINT_NODE_COLD_LOADS)
            waited = (now - queued_at).total_seconds()
            own = max(load_s, node_cold_s(node_id, node_name, load_s=load_s) - waited)  # as loads here have gone
            estimates.append(turns * load_s + own + pauses.get(tenant_id, 0.0))
        elif state == P.WAITING:
            estimates.append(settings.MINT_RESIDENCY_MIN_RESIDENT_S + load_s)
    if not estimates:  # no room was found for it: when its node should have room for it, and its load
        return _room_s(revision_id)
    return min(estimates)


def _room_s(revision_id: int) -> float:
    """The estimate the refusal of a cold request left (serving/services/residency.py, `_refused`), or, without
    one, the minimum residency and a load: by then every entry not in use again has become free."""
    import redis

    try:
        due = redis_client().get(f"{ROOM_PREFIX}:{revision_id}")
    except redis.RedisError:
        due = None
    if due is None:
        return float(settings.MINT_RESIDENCY_MIN_RESIDENT_S) + DEFAULT_LOAD_S
    return max(0.0, float(due) - time.time())


def pause_s(node_id: int, tenant_id: int, now: datetime) -> float:
    """Seconds left of the tenant's pacing pause on the node (serving/services/admission.py); 0 when none."""
    until = (
        PrewarmTurn.objects.filter(node_id=node_id, tenant_id=tenant_id).values_list("resting_until", flat=True).first()
    )
    return pause_left(until, now)


def node_pauses(node_id: int, now: datetime) -> dict[int, float]:
    """Per tenant resting on the node, the seconds left of its pacing pause (one read for all of them)."""
    rows = PrewarmTurn.objects.filter(node_id=node_id, resting_until__gt=now).values_list("tenant_id", "resting_until")
    return {tenant: left for tenant, until in rows if (left := pause_left(until, now)) > 0}


def resting_tenants(node_id: int, now: datetime) -> set[int]:
    """Tenants whose next load on the node waits for its pacing pause: admission passes their queued loads by, so
    those go after any other tenant's load asked for now."""
    return set(node_pauses(node_id, now))


def pause_left(until: datetime | None, now: datetime) -> float:
    """Seconds from `now` to a pause's end `until`; 0 when none, or when MINT_NODE_PREWARM_DUTY of 1 turns pacing
    off (admission then honours no pause)."""
    if until is None or settings.MINT_NODE_PREWARM_DUTY >= 1:
        return 0.0
    return max(0.0, (until - now).total_seconds())


def on_demand_start_s(busy_s: float) -> float:
    """Seconds between the starts of a paced tenant's loads on demand on a node where one keeps it busy `busy_s`:
    the load and the pause after it, at MINT_NODE_COLD_DUTY's share of the node's time (the pause at most
    MINT_NODE_PREWARM_MAX_GAP_S), and at least MINT_NODE_COLD_LOADS_PER_MIN's interval."""
    duty = settings.MINT_NODE_COLD_DUTY
    shared = min(busy_s / duty, busy_s + settings.MINT_NODE_PREWARM_MAX_GAP_S) if duty < 1 else busy_s
    return max(shared, cold_load_interval_s())


def revision_residency(revision_ids: list[int]) -> dict[int, list[dict]]:
    """Where each revision is resident now: per node, its tier (`cpu`: loaded in vLLM, which pages it to the GPU
    batch itself; `loading`; `disk`: only its files on the node's disk), its segment in the node's cache, and
    whether a reserved alias pins it (the caller knows; not here)."""
    found: dict[int, list[dict]] = {r: [] for r in revision_ids}
    loaded: set[tuple[int, str]] = set()
    for revision_id, node, state, segment in Placement.objects.filter(revision_id__in=revision_ids).values_list(
        "revision_id", "node__name", "state", "segment"
    ):
        tier = {P.READY: "cpu", P.QUEUED: "loading", P.LOADING: "loading", P.WARMING: "loading"}.get(state)
        if tier is None:
            continue
        loaded.add((revision_id, node))
        found[revision_id].append({"node": node, "tier": tier, "segment": segment if tier == "cpu" else None})
    for revision_id, node in NodeCopy.objects.filter(revision_id__in=revision_ids).values_list(
        "revision_id", "node__name"
    ):
        if (revision_id, node) not in loaded:
            found[revision_id].append({"node": node, "tier": "disk", "segment": None})
    for entries in found.values():
        entries.sort(key=lambda e: (e["node"], e["tier"]))
    return found


def last_cold_starts(revision_ids: list[int]) -> dict[int, dict]:
    """Each revision's last load on demand (when asked, how long until ready, from where, how many so far)."""
    return {
        c.revision_id: {
            "at": c.asked_at.isoformat(),
            "seconds": round(c.seconds, 3),
            "node": c.node,
            "source": c.source,
            "count": c.count,
        }
        for c in ColdStart.objects.filter(revision_id__in=revision_ids)
    }
