"""The residency policy (serving/residency/policy.py) against the database: what an on-demand load evicts, where.

A node's on-demand cache is rebuilt from its placements at each decision (`node_view`): ready placements of
revisions nobody pins, least recently used first, in the segment each was left in (`Placement.segment`); its
capacity is the node's `cpu_slots` less every slot held otherwise (pinned revisions, loads under way, evictions
not yet unloaded, an evaluation's borrowed slot). Frequencies come from Redis (`frequency()`: every gateway process
adds the requests it routed; a Redis that cannot be read makes the policy plain LRU with segments, never an error).
`busy`: a placement is not evicted for an on-demand load while it waits for the client whose request loaded it
(loaded within MINT_RESIDENCY_MIN_RESIDENT_S, not used since), so that client finds it after its Retry-After; nor
when used within MINT_RESIDENCY_MIN_RESIDENT_S and asked for more than once lately, so a working set larger than
the node waits for room instead of thrashing. One asked for once that served its request may leave at once.
Time-slicing (`_turns`): an entry in use loaded MINT_RESIDENCY_QUANTUM_S ago may leave for a recurring ask that
found no room, so that such a working set is served in turns; an ask refused before a turn ends is told when it
ends, and asked for again then (the `residency_turn` task), so its load starts before its client comes back. So is
a one-off ask refused for its tenant's pacing (a scan's), when its place among that tenant's loads comes.

`on_demand` decides; serving/services/placement.py carries the decision out (evicts, queues) inside its
transaction, with the nodes' rows locked.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Case, CharField, DateTimeField, F, Value, When
from django.utils import timezone

from serving.models import (
    HOLDING_STATES,
    ColdStart,
    NodeCopy,
    Placement,
    PlacementState,
    Priority,
    ServingNode,
    lora_name,
)
from serving.residency import stats
from serving.residency.frequency import SharedCounts
from serving.residency.policy import ONE_OFF, Admission, NodeCache, Segment, Shape, choose_node
from serving.residency.room import RefusedAsks, room_in_s
from serving.selectors.residency import (
    DEFAULT_LOAD_S,
    ROOM_PREFIX,
    cold_load_interval_s,
    node_cold_s,
    node_load_s,
    on_demand_start_s,
    pause_s,
    redis_client,
    resting_tenants,
)

log = logging.getLogger(__name__)
P = PlacementState
_LORA_NAME = re.compile(r"^t[0-9]+-a[0-9]+-r[0-9]+$")  # serving.models.lora_name
FREQUENCY_PREFIX = "mint:residency:freq"
# The same requests over a short period (under FREQUENCY_PREFIX, so cleared with them): how steadily each is asked.
STEADY_PREFIX = f"{FREQUENCY_PREFIX}:steady"
# Half a minute: a busy set's turns start about 20 s after its first requests, and stop as soon after its last
# (benchmarks/long_tail, at a minute: the thrash phase's first 30 s held half its failures, asks told the flat
# estimate while every entry was in use and none yet held a turn; after it, the recovery's first requests joined
# turns of a set no longer asked for).
STEADY_PERIOD_S = 30.0
REFUSED_PREFIX = "mint:residency:refused"
TURN_PREFIX = "mint:residency:turn"  # revision id → a timer asks again for it when its turn comes
PROMISE_PREFIX = "mint:residency:promised"  # node id:entry → the revision whose waiting ask is told its turn's end
ROTATING_PREFIX = "mint:residency:rotating"  # node id → set while a turn there is promised: a busy set takes turns
# A turn promised to a waiting ask is kept for it this long past the turn's end (its timer's lateness).
PROMISE_GRACE_S = 2.0
LATE_KEY = "mint:residency:turn-late"  # how late turns' timers fired, the latest first
# node id → how much later than its pause's end plus its own load time a paced tenant's load was ready there
PACED_LATE_PREFIX = "mint:residency:paced-late"
_LATE_SAMPLE = 20
# An ask whose tenant's pause on a node ends within this is placed there all the same (admission starts its load when
# the pause is over): a client told to come back after a whole number of seconds cannot hit the pause's end exactly.
PACED_GRACE_S = 1.0


def shape() -> Shape:
    return Shape(
        window=settings.MINT_RESIDENCY_WINDOW,
        protected=settings.MINT_RESIDENCY_PROTECTED,
        tenant=settings.MINT_RESIDENCY_TENANT_CAP,
    )


def frequency() -> SharedCounts:
    return SharedCounts(FREQUENCY_PREFIX, settings.MINT_RESIDENCY_FREQUENCY_PERIOD_S)


def steadiness() -> SharedCounts:
    return SharedCounts(STEADY_PREFIX, STEADY_PERIOD_S)


def estimates(revision_ids: list[int]) -> dict[int, int] | None:
    """Requests per revision over the last one or two frequency periods; None when Redis cannot be read."""
    import redis

    try:
        return frequency().estimates(redis_client(), revision_ids, time.time())
    except redis.RedisError as exc:
        log.warning("residency: frequencies unavailable (%s); deciding by recency only", exc)
        return None


def _lookup(revision_ids: list[int], *, incoming: int | None = None) -> Callable[[int], int]:
    """How often the policy reads each of `revision_ids` as asked for. Without frequencies (Redis unreadable)
    recency decides, and no cap opens: every entry counts as recurring (a tenant at its cap never takes another's
    entries for one-off ones), and the `incoming` one as asked for more (it never waits on counts nobody can
    read)."""
    counts = estimates(revision_ids)
    if counts is None:
        return lambda key: ONE_OFF + (2 if key == incoming else 1)
    return lambda key: counts.get(key, 0)


def record_requests(counts: dict[int, int], tiers: dict[tuple[str, str], int] | None = None) -> None:
    """Add requests per revision to the shared frequencies, and requests per node and tier to the per-minute
    stats (a gateway's batch; one pipeline)."""
    if not counts and not tiers:
        return
    now = time.time()
    pipe = redis_client().pipeline(transaction=False)
    frequency().add(pipe, counts, now)
    steadiness().add(pipe, counts, now)
    per_node: dict[str, dict[str, int]] = {}
    for (node, tier), n in (tiers or {}).items():
        per_node.setdefault(node, {})[tier] = n
    for node, by_tier in per_node.items():
        stats.add(pipe, node, by_tier, now)
    pipe.execute()


def _stats(write) -> None:
    """Write residency stats (serving/residency/stats.py); a Redis that is away loses them, nothing else."""
    import redis

    try:
        pipe = redis_client().pipeline(transaction=False)
        write(pipe)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("residency: stats not written (%s)", exc)


def record_load(*, placement: Placement, now: datetime) -> None:
    """A placement became ready: a load on its node (cold: asked by a request; from disk or from the store)."""
    cold_s = (now - placement.queued_at).total_seconds() if placement.priority == Priority.COLD_REQUEST else None
    from_disk = (getattr(placement, "load_source", "") or "") == "disk"
    _stats(lambda pipe: stats.loaded(pipe, placement.node.name, cold_s=cold_s, from_disk=from_disk))


def record_eviction(*, node_name: str) -> None:
    _stats(lambda pipe: stats.add(pipe, node_name, {"evictions": 1}))


@dataclass
class NodeView:
    """One node's on-demand cache as the database holds it now, with what rebuilding it found."""

    node: ServingNode
    cache: NodeCache[int]
    ready: dict[int, Placement]  # revision id → its ready on-demand placement here
    busy: set[int]
    used: set[int] = field(default_factory=set)  # of `busy`, those busy only for having served a request lately
    speculative: list[Placement] = field(default_factory=list)  # ready, borrowed by an evaluation: first to go
    # Loads not ready yet that go before a new one (loading, warming, queued but for those of tenants resting for
    # their pacing pause, which admission passes by), each holding the slot it was given.
    pending: int = 0
    pending_on_demand: Counter[int] = field(default_factory=Counter)  # tenant id → its loads on demand not ready
    recent_tenants: set[int] = field(default_factory=set)  # tenants with a placement here used lately (pacing)


def node_view(
    node: ServingNode,
    *,
    pins: set[int] | dict[int, int],
    activating: Collection[int] = (),
    now: datetime | None = None,
) -> NodeView:
    """Rebuild `node`'s on-demand cache from its placements (the caller holds the node's row lock). `activating`:
    pins of on-demand aliases waiting to flip (`selectors.pins.pins_and_activations`), their tenants' entries."""
    now = now or timezone.now()
    rows = list(Placement.objects.filter(node=node, state__in=HOLDING_STATES).select_related("revision__adapter"))
    ready, loading, fixed, speculative = [], [], 0, []
    for placement in rows:
        if placement.state == P.EVICTING:
            # Its slot is the load's that replaced it (admission starts that load once vLLM has unloaded this one),
            # or free once unloaded: counted here too, both would hold one slot and the cache would shrink twice.
            continue
        evaluating = placement.priority == Priority.SPECULATIVE and placement.state != P.READY
        if placement.revision_id in activating:
            loading.append(placement)  # an on-demand alias's next revision: its tenant's, busy until the flip
        elif placement.revision_id in pins or evaluating:
            fixed += 1  # a pinned revision, or an evaluation's load: outside the cache
        elif placement.state != P.READY:
            loading.append(placement)
        elif placement.priority == Priority.SPECULATIVE:
            speculative.append(placement)
        else:
            ready.append(placement)
    cache_ = NodeCache(node.cpu_slots - fixed - len(speculative), shape())
    ready.sort(key=lambda p: (p.last_used_at or p.ready_at or p.updated_at, p.id))
    segments = set(Segment)
    for placement in ready:
        segment = Segment(placement.segment) if placement.segment in segments else Segment.WINDOW
        cache_.add(placement.revision_id, placement.revision.adapter.tenant_id, segment)
    cache_.rebalance()
    # A load on demand under way is the window's newest entry, busy: it counts towards its tenant's cap, and a
    # scan's next newcomer is weighed against main (not let past because the load left the window a slot short).
    # One taking a turn is loaded in main, where its leaver was (`segment_of`).
    loading.sort(key=lambda p: (p.queued_at or p.updated_at, p.id))
    for placement in loading:
        queued_in = placement.segment if placement.state != P.READY else None  # an activation's: the window
        segment = Segment(queued_in) if queued_in in segments else Segment.WINDOW
        cache_.add(placement.revision_id, placement.revision.adapter.tenant_id, segment)
    since = now - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S)
    lately = now - timedelta(seconds=settings.MINT_NODE_PACING_NEIGHBOUR_S)
    resting = resting_tenants(node.id, now) if any(p.state == P.QUEUED for p in rows) else set()
    busy, used = {p.revision_id for p in loading}, set()
    for p in ready:
        served = p.last_used_at is not None and p.ready_at is not None and p.last_used_at > p.ready_at
        if p.ready_at is not None and p.ready_at >= since and not served:
            busy.add(p.revision_id)  # loaded for a request whose client has not come back for it yet
        elif p.last_used_at is not None and p.last_used_at >= since:
            busy.add(p.revision_id)
            used.add(p.revision_id)
    return NodeView(
        node=node,
        cache=cache_,
        ready={p.revision_id: p for p in ready},
        busy=busy,
        used=used,
        speculative=speculative,
        pending=sum(
            1
            for p in rows
            if p.state in (P.LOADING, P.WARMING)
            or (p.state == P.QUEUED and p.revision.adapter.tenant_id not in resting)
        ),
        pending_on_demand=Counter(
            p.revision.adapter.tenant_id
            for p in rows
            if p.state in (P.QUEUED, P.LOADING, P.WARMING) and p.priority == Priority.COLD_REQUEST
        ),
        recent_tenants={p.revision.adapter.tenant_id for p in rows if p.last_used_at and p.last_used_at >= lately},
    )


@dataclass(frozen=True)
class Decision:
    """Where an on-demand load goes and what it evicts (none: a free slot), or `node` None: no room now."""

    node: ServingNode | None
    evict: list[Placement]
    view: NodeView | None = None
    # No room: seconds until its load may start (the turn or the entry it waits for frees, its tenant's pacing lets
    # it), when the caller asks again for it (the `residency_turn` task), not when its client comes back.
    ask_again_s: float | None = None


def on_demand(
    *,
    revision_id: int,
    tenant_id: int,
    order: list[ServingNode],
    held: dict[int, int],
    pins: set[int] | dict[int, int],
    on_disk: set[int],
    activating: Collection[int] = (),
) -> Decision:
    """Where a request's revision (loaded nowhere) is loaded: the first node in its preference `order` with a
    free slot (`held`: slots taken per node id), else the best node holding its files (`on_disk`: node ids), else
    its home, making room there by the policy. Tries the next nodes of its order while a node has no room
    (everything there busy, the tenant at its cap with only busy entries, or a rarely asked entry while the
    window is busy). The caller holds the nodes' row locks."""
    node = choose_node(
        order,
        free=lambda n: n.cpu_slots - held.get(n.id, 0),
        on_disk=lambda n: n.id in on_disk,
        disk_choices=settings.MINT_RESIDENCY_DISK_CHOICES,
    )
    if node is None:
        return Decision(None, [])
    if held.get(node.id, 0) < node.cpu_slots:
        return _placed(Decision(node, []), revision_id, tenant_id)
    tried = [node, *(n for n in order if n.id != node.id)][: settings.MINT_RESIDENCY_NODE_CHOICES]
    refused: list[Refusal] = []
    recurring: bool | None = None  # read once, on the first node that paces the tenant
    for candidate in tried:
        view = node_view(candidate, pins=pins, activating=activating)
        if (paced := _paced_s(view, tenant_id)) > PACED_GRACE_S:
            # The tenant's loads here are paced while others use the node (serving/services/admission.py): an
            # eviction now would empty a slot that its load may not fill until the pause is over, and a scan's
            # queued loads would hold the others' asks back (`pending`, below). No room for it here now.
            if recurring is None:
                recurring = _lookup([revision_id], incoming=revision_id)(revision_id) > ONE_OFF
            refused.append(Refusal(view, idle=True, paced_s=paced, recurring=recurring))
            continue
        if view.pending > settings.MINT_NODE_COLD_LOADS:
            # Loads wait here already beyond those the node runs at once. An eviction now would empty a slot that
            # no load fills for a while (the victim leaves at once, its replacement waits its turn): with requests
            # missing faster than the node loads, each queued load takes a ready entry with it and the node drains
            # to a few ready revisions (benchmarks/long_tail: 16 ready fell to 1-3 behind a dozen queued loads,
            # every request then a miss). No room here now: the request gets its 503 and asks again.
            refused.append(Refusal(view, idle=True))
            continue
        if view.speculative:  # an evaluation's borrowed slot is given back first
            return _placed(Decision(candidate, [view.speculative[0]], view), revision_id, tenant_id)
        asked = _lookup([revision_id, *(view.ready.keys() | view.busy)], incoming=revision_id)
        # A one-off entry that served the request it was loaded for is kept for nobody: it may leave at once (a
        # scan's, a tail request's), so the window turns over as fast as the node loads.
        busy = view.busy - {k for k in view.used if asked(k) <= ONE_OFF}
        outcome = view.cache.miss(revision_id, tenant_id, frequency=asked, busy=busy)
        if not outcome.admitted:  # everything here in use: a recurring ask may take a turn that is over
            turns = _turns(view, revision_id, tenant_id, asked)
            if over := _free_turns(view.node.id, turns.over, revision_id):
                turn = view.cache.take_turn(revision_id, tenant_id, over=over, busy=busy)
                outcome = Admission(turn.admitted, [*outcome.evicted, *turn.evicted])
                if turn.admitted:
                    _promise_kept(view.node.id, turn.evicted)
        if outcome.admitted:
            return _placed(Decision(candidate, [view.ready[k] for k in outcome.evicted], view), revision_id, tenant_id)
        refused.append(Refusal(view, idle=False, turns=turns))
    return Decision(None, [], ask_again_s=_refused(revision_id, tenant_id, refused))


def refused_asks() -> RefusedAsks:
    # Kept longer than a client's retries last: the openai client's two, each after a Retry-After of a few seconds,
    # or, for a paced tenant's asks, of several intervals (its own asks before it each take one).
    # A recurring ask may wait for an entry's turn besides.
    keep_s = 3 * (settings.MINT_RESIDENCY_MIN_RESIDENT_S + DEFAULT_LOAD_S) + 6 * cold_load_interval_s() + quantum_s()
    return RefusedAsks(REFUSED_PREFIX, keep_s)


def _placed(decision: Decision, revision_id: int, tenant_id: int) -> Decision:
    """A load on demand found room: its ask no longer waits (serving/residency/room.py)."""
    _ask_answered(decision.node.base_model_id, tenant_id, revision_id)
    return decision


def ask_answered(*, placement: Placement) -> None:
    """A revision became ready on a node, whichever path placed it (a request's, an activation's, a spread): an ask
    of it refused earlier no longer waits, and no longer pushes back the asks refused after it."""
    _ask_answered(placement.node.base_model_id, placement.revision.adapter.tenant_id, placement.revision_id)


def _ask_answered(base_model_id: int, tenant_id: int, revision_id: int) -> None:
    import redis

    try:
        refused_asks().placed(redis_client(), base_model_id, tenant_id, revision_id)
    except redis.RedisError as exc:
        log.warning("residency: refused asks not updated (%s)", exc)


@dataclass(frozen=True)
class Refusal:
    """A node that refused a load on demand: `idle`, for the loads queued there or its tenant's pacing, not for want
    of room (its idle entries may leave once those have started); `paced_s`, the tenant's pacing left there;
    `turns`, for a recurring ask, those of the entries there that it may take when their turn ends; `recurring`,
    for a paced one, whether it is asked for more than once lately."""

    view: NodeView
    idle: bool
    paced_s: float = 0.0
    recurring: bool = False
    turns: Turns = field(default_factory=lambda: NO_TURNS)


@dataclass(frozen=True)
class Turns:
    """Time-slicing on one node for a recurring ask: the entries in use whose turn is over (the longest loaded
    first), and seconds until each entry that the ask may take ends its turn (0 for those over)."""

    over: list[int]
    ends_s: tuple[float, ...]
    keys: tuple[int, ...]  # the entries whose turns `ends_s` are, in the same order
    own_only: bool = False  # its tenant at its cap there: these are its own entries' turns only
    # Seconds until each turn ends that asks before it may take and it may not: entries asked for more than
    # 1/TURN_PEERS times as often (none when `own_only`: the asks before it that count then take its tenant's only).
    theirs_s: tuple[float, ...] = ()


NO_TURNS = Turns([], (), ())


def quantum_s() -> float:
    """An on-demand entry's turn (MINT_RESIDENCY_QUANTUM_S; never shorter than the minimum residency); 0: none."""
    quantum = settings.MINT_RESIDENCY_QUANTUM_S
    return max(quantum, settings.MINT_RESIDENCY_MIN_RESIDENT_S) if quantum else 0.0


# An entry in use takes turns only with asks at least this fraction as frequent: a tenant's adapter answering four
# requests a second does not leave for one asked for twice in a few minutes, only for its peers in a busy set.
TURN_PEERS = 0.5


def _turns(view: NodeView, revision_id: int, tenant_id: int, asked: Callable[[int], float]) -> Turns:
    """The turns on the view's node that the ask of `revision_id` may wait for: none for a one-off ask (a scan, a
    tail request: they never push out what is in use) or without time-slicing; otherwise those of the node's
    recurring entries that are in use, loading, or waiting for their client (each then used for a turn), asked for
    often enough to stay in use, and no more than 1/TURN_PEERS times as often as the ask, of its own tenant only
    when it is at its cap. A turn ends a quantum after its entry became ready (a load under way: after the node's
    load time from now)."""
    quantum, incoming = quantum_s(), asked(revision_id)
    if not quantum or (incoming <= ONE_OFF and not _came_back(view, tenant_id, revision_id)):
        return NO_TURNS
    steady = _steady(view.busy)
    if incoming <= ONE_OFF:
        # A first request whose client came back while a busy set takes turns here joins them, as that set's least
        # asked entry: otherwise it would find every entry in use until the set is gone (benchmarks/long_tail: the
        # recovery after the thrash phase). A scan's asks still take no turn while no busy set is served in turns.
        peers = [often for key in steady if (often := asked(key)) > ONE_OFF]
        if not peers:
            return NO_TURNS
        incoming = min(peers)
    own_only = view.cache.at_cap(tenant_id)
    now, load_s = timezone.now(), None

    def turn_end(key: int) -> float:
        nonlocal load_s
        placement = view.ready.get(key)
        if placement is not None and placement.ready_at is not None:
            ready_at = placement.ready_at
        else:
            load_s = node_load_s(view.node.id) if load_s is None else load_s
            ready_at = now + timedelta(seconds=load_s)
        return max(0.0, (ready_at - now).total_seconds() + quantum)

    peers, theirs = [], []
    for key in view.busy:
        often = asked(key)
        if often <= ONE_OFF or key not in steady:
            continue
        if own_only and view.cache.tenant_of(key) != tenant_id:
            continue
        if often * TURN_PEERS > incoming:
            if not own_only:
                theirs.append(turn_end(key))
            continue
        peers.append((turn_end(key), key))
    peers.sort()
    ends = tuple(end for end, _ in peers)
    over = [key for end, key in peers if end == 0.0 and key in view.used]
    return Turns(over, ends, tuple(key for _, key in peers), own_only, tuple(theirs))


def _came_back(view: NodeView, tenant_id: int, revision_id: int) -> bool:
    """Whether the ask of `revision_id` was refused at least a minimum residency ago (its client came back after the
    Retry-After it was told) while a busy set takes turns on the view's node (a turn there promised). Without
    Redis, no."""
    import redis

    try:
        client = redis_client()
        if not client.exists(f"{ROTATING_PREFIX}:{view.node.id}"):
            return False
        waited = refused_asks().waiting_s(client, view.node.base_model_id, tenant_id, revision_id, time.time())
    except redis.RedisError:
        return False
    return waited is not None and waited >= settings.MINT_RESIDENCY_MIN_RESIDENT_S


def _steady(keys: Collection[int]) -> set[int]:
    """Of `keys`, those asked for at least once per minimum residency on average over the last STEADY_PERIOD_S, so
    expected to be used again before they would free by themselves: each stays in use until its turn ends. One asked
    for less (a client going through its adapters one by one) frees soon after its last use, as before turns. The
    short period lets a busy set's turns start within half a minute of its first requests, where the frequency
    period's counts (minutes) would not. Without Redis, none."""
    import redis

    bar = STEADY_PERIOD_S / max(settings.MINT_RESIDENCY_MIN_RESIDENT_S, 1e-3)
    try:
        counts = steadiness().in_last_period(redis_client(), keys, time.time())
    except redis.RedisError as exc:
        log.warning("residency: steadiness unavailable (%s); no turns", exc)
        return set()
    return {key for key, n in counts.items() if n >= bar}


def _free_turns(node_id: int, over: list[int], revision_id: int) -> list[int]:
    """Of the entries whose turn is over, those the ask of `revision_id` may take: not promised to another ask (a
    waiting ask told that turn's end, for PROMISE_GRACE_S past it), the one promised to it first. Without Redis,
    all of them."""
    import redis

    if not over:
        return []
    try:
        promised = redis_client().mget([f"{PROMISE_PREFIX}:{node_id}:{key}" for key in over])
    except redis.RedisError:
        return over
    mine = str(revision_id).encode()
    return [k for k, p in zip(over, promised, strict=True) if p == mine] + [
        k for k, p in zip(over, promised, strict=True) if p is None
    ]


def _promise_kept(node_id: int, taken: list[int]) -> None:
    import redis

    try:
        if taken:
            redis_client().delete(*(f"{PROMISE_PREFIX}:{node_id}:{key}" for key in taken))
    except redis.RedisError as exc:
        log.warning("residency: turn promises not cleared (%s)", exc)


def _paced_s(view: NodeView, tenant_id: int) -> float:
    """Seconds before the tenant's next load on demand may start on the view's node, while another tenant uses it
    (serving/services/admission.py paces it then): its pause left, and while a load of its own waits or runs
    there, that load's time and the interval between two (MINT_NODE_COLD_LOADS_PER_MIN) besides. 0: now."""
    if settings.MINT_NODE_PACING_NEIGHBOUR_S and not view.recent_tenants - {tenant_id}:
        return 0.0  # nobody else here lately (a window of 0: paced whoever else uses the node)
    paced = pause_s(view.node.id, tenant_id, timezone.now())
    if view.pending_on_demand[tenant_id]:
        paced = max(paced, on_demand_start_s(node_load_s(view.node.id)))
    return paced


def _refused(revision_id: int, tenant_id: int, refused: list[Refusal]) -> float | None:
    """A cold request found no room on the nodes tried: note when it should (serving/residency/room.py), for its
    `Retry-After` (`selectors.residency.expected_ready_s`). Without Redis, the estimate stays the flat one.
    Returns, when the room is an entry known to free (an entry's turn ending, one loaded for another request, the
    loads queued ahead started) or the tenant's pacing lets its load start, and no timer waits for it yet, when to
    ask again."""
    import redis

    if not refused:
        return None
    now, clock = timezone.now(), time.time()
    min_s = settings.MINT_RESIDENCY_MIN_RESIDENT_S
    try:
        client = redis_client()
        asks, base_model_id = refused_asks(), refused[0].view.node.base_model_id
        turn = asks.ahead(client, base_model_id, tenant_id, revision_id, clock)
        best = None
        for refusal in refused:
            view, load_s = refusal.view, node_load_s(refusal.view.node.id)
            turns, ahead = refusal.turns, turn.ahead
            if turns.own_only:
                # Its tenant is at its cap here: it waits for its own entries only, and the asks before it that
                # compete for those are its own and those of tenants below their caps here (one at its cap takes
                # only its own). Counted against its own few turns, every tenant's asks made rounds that never
                # came (benchmarks/long_tail's thrash phase: the tenant at its cap was told over 120 s, which the
                # openai client does not wait for).
                ahead = turn.competing(view.cache.at_cap)
            # When each entry it may take should be free: at its turn's end, for a recurring ask (time-slicing);
            # loaded for a request whose client is not back yet, or loading, at the minimum residency.
            frees: list[tuple[float, int | None]] = list(zip(turns.ends_s, turns.keys, strict=True))
            for key in view.busy - view.used - set(turns.keys):
                if turns.own_only and view.cache.tenant_of(key) != tenant_id:
                    continue
                ready_at = view.ready[key].ready_at if key in view.ready else None
                frees.append(((ready_at - now).total_seconds() + min_s if ready_at else load_s + min_s, None))
            if refusal.idle:  # its idle entries may leave once the queued loads have started, or the pause is over
                frees += [(0.0, None)] * len(view.ready.keys() - view.busy)
            room_s = room_in_s(
                [free for free, _ in frees],
                ahead=ahead,
                pending=view.pending,
                parallel=settings.MINT_NODE_COLD_LOADS,
                load_s=load_s,
                min_resident_s=min_s,
                quantum_s=quantum_s() if turns.ends_s else 0.0,
                theirs=turns.theirs_s,  # asks ahead beyond its own turns spread over these too (`place_of`)
            )
            cold_s = node_cold_s(view.node.id, view.node.name, load_s=load_s)
            # When its load may start: when the room it waits for frees, if that is an entry known to free (not the
            # flat guess for more asks than entries freeing); a second at least, as a Retry-After.
            due, start = room_s + cold_s, max(room_s, 1.0) if ahead < len(frees) else None
            if refusal.paced_s:  # the pause, the tenant's asks before it one start each, then its own load
                # Each of those loads is ready later than its pause's end and load time say, by the hand-offs
                # around it (admission after the pause, the agent's tasks): as much as the node's last ones were.
                late = paced_late_s(client, view.node.id)
                begins = refusal.paced_s + turn.own * (on_demand_start_s(load_s) + late)
                due = max(due, begins + late + load_s)
                # A recurring ask waits for a turn besides, whose timer starts its load. Asked again within the
                # grace before its pause ends, its load is queued then and starts as the pause ends.
                start = None if refusal.recurring else max(begins - PACED_GRACE_S / 2, room_s)
            if best is None or due < best[0]:
                # The turn it waits for: the one its place among the waiting asks gives it, when that is a turn.
                ranked = sorted(frees, key=lambda free: (max(0.0, free[0]), free[1] is None))
                promised = ranked[ahead][1] if ahead < len(ranked) and turns.ends_s else None
                best = (due, room_s, view.node.id, promised, start)
        due, room_s, node_id, promised, start = best
        if promised is not None or start is not None:  # its load starts when the timer fires, a little late
            due += turn_late_s(client)
        timer = promised is not None or (start is not None and start < asks.keep_s)
        back_at = clock + max(1, math.ceil(due))
        pipe = client.pipeline(transaction=False)
        pipe.set(f"{ROOM_PREFIX}:{revision_id}", f"{clock + due:.3f}", ex=max(1, math.ceil(due) + 1))
        # Told to come back then (`Retry-After`, rounded up): a client that does not has given up, and its ask stops
        # holding back those behind it (after the thrash phase of benchmarks/long_tail, asks whose clients had run
        # out of retries kept first requests waiting for up to a minute).
        if not _ASKED_AGAIN.get():  # a timer's refusal tells the client nothing: one gone stays gone
            if not timer and back_at + asks.grace_s > turn.first + asks.keep_s:
                # Its client is told to come back only after the ask would be forgotten, and no timer loads it
                # before: holding its place until then only holds back the asks behind it (benchmarks/long_tail:
                # the thrash phase's asks told minutes held the first requests after it). Coming back, it starts
                # again at the back, as it would have.
                asks.forget(pipe, base_model_id, tenant_id, revision_id)
            else:
                asks.expect(pipe, base_model_id, tenant_id, revision_id, back_at)
        pipe.execute()
        if promised is None:
            # Asked again when its room should be there, or its place among a paced tenant's loads comes, so that
            # its load starts then and is ready when its client comes back. Left to its client, the load started
            # only then: the client's first retry found it loading and its second was its last (a paced scan's
            # found the pace taken by the tenant's other asks coming back at about the same time, and ran out of
            # retries: benchmarks/long_tail, up to 14 a run).
            # Not when the ask would be forgotten before then, nor for a room no entry is known to free by then:
            # a tenant flooding cold asks would otherwise fill the shared worker with timers that find nothing to
            # do. So one timer per revision at most, and only for an entry known to free or a paced start.
            if timer and client.set(f"{TURN_PREFIX}:{revision_id}", 1, nx=True, ex=math.ceil(start) + 1):
                return start
            return None
        # That turn is kept for this ask a moment past its end (another ask coming then does not take it), and a
        # timer asks again for it then: one timer per revision at a time.
        hold = math.ceil(room_s + PROMISE_GRACE_S)
        client.set(f"{PROMISE_PREFIX}:{node_id}:{promised}", revision_id, nx=True, ex=hold)
        client.set(f"{ROTATING_PREFIX}:{node_id}", 1, ex=hold)
        if client.set(f"{TURN_PREFIX}:{revision_id}", 1, nx=True, ex=math.ceil(room_s) + 1):
            return room_s
    except redis.RedisError as exc:
        log.warning("residency: no room estimate for revision %s (%s)", revision_id, exc)
    return None


def _keep_late(key: str, seconds: float) -> None:
    """Keep how late something came (`seconds`), the last _LATE_SAMPLE of them under `key`, for `_late_s`."""
    import redis

    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.lpush(key, f"{max(0.0, seconds):.3f}")
        pipe.ltrim(key, 0, _LATE_SAMPLE - 1)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("residency: lateness not kept (%s)", exc)


def _late_s(client, key: str) -> float:
    late = [float(v) for v in client.lrange(key, 0, -1)]
    return statistics.median(late) if late else 0.0


def turn_late(seconds: float) -> None:
    """A turn's timer fired `seconds` after the turn's end (the worker busy with another task, the broker's
    hand-off): kept for `turn_late_s`."""
    _keep_late(LATE_KEY, seconds)


def turn_late_s(client) -> float:
    """The median of how late turns' timers fired lately (0 before any): the load of a waiting ask starts that
    long after its turn's end."""
    return _late_s(client, LATE_KEY)


def paced_late(*, node_id: int, seconds: float) -> None:
    """A paced tenant's load on demand that waited for its pause (serving/services/admission.py) was ready
    `seconds` later than the pause's end and its own load time: kept for `paced_late_s`."""
    _keep_late(f"{PACED_LATE_PREFIX}:{node_id}", seconds)


def paced_late_s(client, node_id: int) -> float:
    """The median of how late paced loads on the node were lately (0 before any): each of a paced tenant's loads
    there starts its pacing interval and that much after the one before."""
    return _late_s(client, f"{PACED_LATE_PREFIX}:{node_id}")


# Set while a timer asks again for a refused ask (`asked_again`): its client was told nothing new, so a refusal then
# does not move the time by which that client must be back (`RefusedAsks.expect`).
_ASKED_AGAIN: ContextVar[bool] = ContextVar("residency_asked_again", default=False)


@contextmanager
def asked_again() -> Iterator[None]:
    """The placement inside is a timer's (`serving/services/placement.py`, `placement_turn`), not a client's."""
    token = _ASKED_AGAIN.set(True)
    try:
        yield
    finally:
        _ASKED_AGAIN.reset(token)


def turn_due(revision) -> bool:
    """The timer for the revision's turn (its adapter loaded) fired: it is cleared (a refusal now may set the next),
    and whether the ask it was set for still waits (not placed meanwhile, not given up)."""
    import redis

    adapter, now = revision.adapter, time.time()
    try:
        client = redis_client()
        client.delete(f"{TURN_PREFIX}:{revision.id}")
        return refused_asks().waiting(client, adapter.base_model_id, adapter.tenant_id, revision.id, now)
    except redis.RedisError as exc:
        log.warning("residency: refused asks unreadable (%s)", exc)
        return False


def make_room(
    *,
    order: list[ServingNode],
    pins: set[int] | dict[int, int],
    activating: Collection[int] = (),
    tenant_id: int | None = None,
) -> Decision:
    """Where a pinned revision (a reserved alias, an activation, a canary) may take an on-demand entry's slot:
    the first node of its order with one to give, the policy choosing which (busy ones too: a pin outranks the
    cache, and an unload waits for the requests in flight). With `tenant_id`, the revision is an on-demand alias's
    activation of that tenant: room is made within the tenant's cap, so that activating many aliases at once
    cannot push out other tenants' recurring entries."""
    for node in order:
        view = node_view(node, pins=pins, activating=activating)
        if view.speculative:
            return Decision(node, [view.speculative[0]], view)
        view.cache.capacity -= 1  # the slot the pin takes
        if len(view.cache) <= view.cache.capacity:
            return Decision(node, [], view)  # one is freeing (an unload with no load queued in its place)
        if not view.ready:
            continue
        asked = _lookup(list(view.ready))
        loading = view.busy - view.ready.keys()  # loads under way: nothing to unload yet
        evicted = view.cache.shrink(frequency=asked, busy=loading, tenant=tenant_id)
        if evicted:
            return Decision(node, [view.ready[k] for k in evicted], view)
    return Decision(None, [])


def segment_of(decision: Decision, revision_id: int) -> str:
    """The segment a load decided on demand enters: the window, but where its entry took a turn (main)."""
    entered = decision.view.cache.segment_of(revision_id) if decision.view is not None else None
    return str(entered or Segment.WINDOW)


def save_segments(view: NodeView) -> int:
    """Write back the segments the decision moved entries to (one UPDATE)."""
    changed = {
        p.id: str(view.cache.segment_of(revision_id))
        for revision_id, p in view.ready.items()
        if view.cache.segment_of(revision_id) is not None and str(view.cache.segment_of(revision_id)) != p.segment
    }
    if not changed:
        return 0
    value = Case(*(When(id=i, then=Value(s)) for i, s in changed.items()), output_field=CharField())
    return Placement.objects.filter(id__in=list(changed)).update(segment=value)


def promoted() -> Case:
    """The segment of a placement that served a request again, for an UPDATE: from probation to protected (its
    node's cache demotes protected overflow when it is next rebuilt), any other as it was."""
    return Case(When(segment=Segment.PROBATION, then=Value(Segment.PROTECTED)), default=F("segment"))


def disk_nodes(revision_id: int) -> set[int]:
    """The nodes that hold the revision's export on their local disk."""
    return set(NodeCopy.objects.filter(revision_id=revision_id).values_list("node_id", flat=True))


# ---------------------------------------------------------------- the disk tier (node-local copies)


def node_copy_used(*, placement: Placement, size_bytes: int) -> None:
    """The node agent loaded the placement from its local copy (`placement.load_source`: `disk` if the copy was
    there already, `store` if fetched now): record the copy as just used, and where the load came from."""
    now = timezone.now()
    NodeCopy.objects.update_or_create(
        node_id=placement.node_id,
        revision_id=placement.revision_id,
        defaults={"size_bytes": size_bytes, "last_used_at": now},
        create_defaults={"size_bytes": size_bytes, "last_used_at": now, "fetched_at": now},
    )
    source = getattr(placement, "load_source", "") or ""
    Placement.objects.filter(id=placement.id).update(load_source=source)


def node_copies_over_budget(*, node: ServingNode) -> list[NodeCopy]:
    """The node's least recently used copies to remove so its copies fit MINT_NODE_DISK_BYTES, leaving out any a
    placement of the node holds (loaded, loading or being unloaded)."""
    copies = list(NodeCopy.objects.filter(node=node).select_related("revision__adapter").order_by("last_used_at", "id"))
    total = sum(c.size_bytes for c in copies)
    budget = settings.MINT_NODE_DISK_BYTES
    if total <= budget:
        return []
    held = set(Placement.objects.filter(node=node).values_list("revision_id", flat=True))
    victims = []
    for copy in copies:
        if total <= budget:
            break
        if copy.revision_id in held:
            continue
        victims.append(copy)
        total -= copy.size_bytes
    return victims


def node_copy_removed(*, copy: NodeCopy) -> None:
    NodeCopy.objects.filter(id=copy.id).delete()


def node_copy_forget(*, node: ServingNode, name: str) -> None:
    """The node agent removed the files under LoRA name `name` (t<tenant>-a<adapter>-r<number>)."""
    try:
        _, adapter, number = (int(part[1:]) for part in name.split("-"))
    except ValueError:
        return
    NodeCopy.objects.filter(node=node, revision__adapter_id=adapter, revision__number=number).delete()


def cold_start_done(*, placement: Placement, now: datetime) -> None:
    """A load asked for by a request is ready: the revision's last cold start (shown on its page and API)."""
    seconds = max(0.0, (now - placement.queued_at).total_seconds())
    node = placement.node.name if hasattr(placement, "node") else ""
    source = getattr(placement, "load_source", "") or ""
    updated = ColdStart.objects.filter(revision_id=placement.revision_id).update(
        node=node, asked_at=placement.queued_at, seconds=seconds, source=source, count=F("count") + 1
    )
    if not updated:
        ColdStart.objects.get_or_create(
            revision_id=placement.revision_id,
            defaults={"node": node, "asked_at": placement.queued_at, "seconds": seconds, "source": source},
        )


def stray_loras(*, node: ServingNode, loaded: set[str]) -> list[str]:
    """LoRA names the engine holds that no placement of the node accounts for (an unload lost between the two,
    a placement deleted while its load finished): the heartbeat unloads them, so what the control plane thinks
    the engine holds stays what the engine holds."""
    ours = {n for n in loaded if _LORA_NAME.match(n)}
    if not ours:
        return []
    known = {lora_name(p.revision) for p in Placement.objects.filter(node=node).select_related("revision__adapter")}
    return sorted(ours - known)


# ---------------------------------------------------------------- use (from the gateway)

_TOUCH_CHUNK = 500


def placements_touch(*, used: dict[int, datetime]) -> int:
    """Record when placements last answered a request (eviction is LRU on it): one UPDATE per chunk of ids,
    `SET last_used_at = CASE id WHEN … END`, which also moves an on-demand placement served again from probation
    to protected (serving/residency/policy.py). The gateway batches uses and calls this from a database thread."""
    ids = sorted(used)
    written = 0
    for start in range(0, len(ids), _TOUCH_CHUNK):
        chunk = ids[start : start + _TOUCH_CHUNK]
        value = Case(*(When(id=i, then=Value(used[i])) for i in chunk), output_field=DateTimeField())
        written += Placement.objects.filter(id__in=chunk).update(last_used_at=value, segment=promoted())
    return written
