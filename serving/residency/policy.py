"""One node's on-demand LoRA slots as a cache: W-TinyLFU admission with a cap per tenant, and where a miss loads.

A node holds, in vLLM's CPU LoRA cache (`--max-cpu-loras`, the node's `cpu_slots`), its *reserved* revisions
(aliases a tenant reserved: never evicted for another tenant, outside this cache) and *on-demand* ones: every other
live revision, loaded when a request asks for it and evicted when cold. A miss always loads (the request cannot be
answered otherwise); the cache decides what leaves to make room. Plain LRU lets one tenant touching thousands of
cold adapters once each push out everybody's hot ones (a scan); here, as in Caffeine's W-TinyLFU (Einziger,
Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", 2017):

- a new entry enters a small *window* (LRU), so a burst of new revisions churns only the window;
- an entry pushed out of the window joins the *main* region only if it was asked for more often lately
  (`frequency`) than main's own victim, the least recently used entry of its *probation* segment; the loser leaves;
- an entry hit again in probation moves to *protected* (most of main), whose overflow goes back to probation.

Frequency decides what stays, within two bounds that keep one tenant from spending another's slots:

- *a tenant's cap*: a tenant holding its cap (`Shape.tenant` of the slots, or the slots ÷ the tenants with entries
  here if more) makes room from its own entries or from one-off entries (asked for at most once lately), never
  from another tenant's recurring entries, however often it asks: no tenant can push out another's hot set by
  asking for many adapters often. Below its cap it takes the best victim of all, so a tenant whose few adapters
  are busy keeps them against many tenants' rarely used ones (benchmarks/long_tail: with the cap at an equal
  share, 16 slots among 13 tenants, the hot tenant's 4 adapters at 4 requests a second thrashed in 1-2 slots);
- *a scan waits*: when every window entry is busy (a tenant's concurrent first requests, its loads), the
  newcomer itself is the window's candidate: if main's victim is recurring and asked for at least as often, the
  request waits for room (503 and `Retry-After`) instead of pushing it out without a comparison.

Entries that are `busy` (a load under way, one waiting for the client that asked for it, a recurring one in use:
the caller decides) are never victims: the node may stay over capacity until one frees (`shrink` again).

Pure: no I/O, no clock. The control plane rebuilds a node's cache from its placements at each decision
(serving/services/residency.py); benchmarks/long_tail replays traces through the same object.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
N = TypeVar("N")


class Segment(StrEnum):
    WINDOW = "window"
    PROBATION = "probation"
    PROTECTED = "protected"


# An entry asked for no more often than this lately (a scan's, a first request's) holds no claim to its tenant's
# share: fairness keeps a tenant's recurring working set, not whatever it touched once (benchmarks/long_tail: with
# the claim, tenants' one-off entries held slots that the hot tenants' working sets needed, below plain LRU).
ONE_OFF = 1

_WINDOW = (Segment.WINDOW,)
_MAIN = (Segment.PROBATION, Segment.PROTECTED)


@dataclass(frozen=True)
class Shape:
    """How a node's on-demand slots are divided: the window's fraction of them (one slot at least), the
    protected segment's fraction of the rest (main), and the fraction one tenant may hold before it makes room
    only from its own or one-off entries (its cap; an equal share instead, when that is more)."""

    window: float = 0.2
    protected: float = 0.8
    tenant: float = 0.5


class NodeCache(Generic[K]):
    """The on-demand entries of one node (revision keys with their tenants), in three LRU segments."""

    __slots__ = (
        "_by",
        "_capacity",
        "_protected_size",
        "_segment",
        "_tenant",
        "_window_size",
        "owned",
        "probation",
        "protected",
        "shape",
        "window",
    )

    def __init__(self, capacity: int, shape: Shape = Shape()) -> None:
        self.shape = shape
        self.capacity = max(0, capacity)
        # Least recently used first in each.
        self.window: OrderedDict[K, None] = OrderedDict()
        self.probation: OrderedDict[K, None] = OrderedDict()
        self.protected: OrderedDict[K, None] = OrderedDict()
        self._by = {Segment.WINDOW: self.window, Segment.PROBATION: self.probation, Segment.PROTECTED: self.protected}
        self._segment: dict[K, Segment] = {}
        self._tenant: dict[K, int] = {}
        self.owned: Counter[int] = Counter()  # entries per tenant

    def __len__(self) -> int:
        return len(self._segment)

    def __contains__(self, key: object) -> bool:
        return key in self._segment

    def segment_of(self, key: K) -> Segment | None:
        return self._segment.get(key)

    def tenant_of(self, key: K) -> int | None:
        return self._tenant.get(key)

    def free(self) -> int:
        return max(0, self.capacity - len(self._segment))

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        # The segments' sizes follow the capacity (a caller lowers it to make room for a pin): worked out once here,
        # not at every decision.
        self._capacity = value
        self._window_size = max(1, round(value * self.shape.window)) if value else 0
        self._protected_size = int((value - self._window_size) * self.shape.protected)

    def window_size(self) -> int:
        return self._window_size

    def protected_size(self) -> int:
        return self._protected_size

    # ------------------------------------------------------------------ what the caller tells it

    def add(self, key: K, tenant: int, segment: Segment = Segment.WINDOW) -> None:
        """Record an entry as most recently used in `segment` (rebuilding from stored state: add in LRU order)."""
        if key in self._segment:
            self.remove(key)
        self._tenant[key] = tenant
        self.owned[tenant] = self.owned.get(tenant, 0) + 1  # .get: Counter's own default is a Python call
        self._put(key, segment)

    def remove(self, key: K) -> None:
        """Forget an entry (unloaded, or its placement gone)."""
        segment = self._segment.pop(key, None)
        if segment is None:
            return
        del self._by[segment][key]
        tenant = self._tenant.pop(key)
        left = self.owned[tenant] - 1
        if left:
            self.owned[tenant] = left
        else:
            del self.owned[tenant]

    def hit(self, key: K) -> list[tuple[K, Segment]]:
        """A request was served from `key`: most recently used, and promoted from probation to protected (whose
        overflow is demoted to probation). Returns the entries whose segment changed, with their new one."""
        segment = self._segment.get(key)
        if segment is Segment.WINDOW or segment is Segment.PROTECTED:
            self._by[segment].move_to_end(key)
        elif segment is Segment.PROBATION:
            self._move(key, Segment.PROTECTED)
            return [(key, Segment.PROTECTED), *self.rebalance()]
        return []

    def miss(self, key: K, tenant: int, *, frequency: Callable[[K], float], busy: Collection[K] = ()) -> Admission[K]:
        """Take in `key` (to be loaded now for a request) if room can be made: the entries that must leave, in the
        order chosen (usually none or one). Not admitted, with nothing else changed, when no entry may leave (all
        busy, the tenant at its cap with all of its own busy, or a rarely asked entry while the window is busy):
        the request waits for room instead of pushing out what is being used, which is what keeps a busy working
        set larger than the node from thrashing."""
        # Already over (the capacity fell, or entries no longer busy kept the window long): back within first. Busy
        # window entries (loads under way) do not count: settling would move idle ones to main unweighed.
        over = len(self._segment) > self._capacity or (
            len(self.window) > self._window_size
            and (not busy or sum(key not in busy for key in self.window) > self._window_size)
        )
        evicted = self.shrink(frequency=frequency, busy=busy, tenant=tenant) if over else []
        if len(self._segment) + 1 > self._capacity:
            victim = self._victim(frequency, busy, tenant, incoming=key)
            if victim is None:
                return Admission(False, evicted)
            self.remove(victim)
            evicted.append(victim)
        self.add(key, tenant, Segment.WINDOW)
        self._settle(_with(busy, key))
        return Admission(True, evicted)

    def shrink(
        self, *, frequency: Callable[[K], float], busy: Collection[K] = (), tenant: int | None = None
    ) -> list[K]:
        """Evict until within capacity (or nothing evictable is left), then move the window's overflow to main.
        For `tenant` (making room for one of its entries), within its cap."""
        evicted: list[K] = []
        while len(self._segment) > self.capacity:
            victim = self._victim(frequency, busy, tenant)
            if victim is None:
                break  # everything is busy: over capacity until something frees
            self.remove(victim)
            evicted.append(victim)
        self._settle(busy)
        return evicted

    def take_turn(self, key: K, tenant: int, *, over: Sequence[K], busy: Collection[K] = ()) -> Admission[K]:
        """Take in `key`, a recurring ask that `miss` found no room for, in place of the first of `over` (entries in
        use whose turn is over, the caller's order: the longest loaded first) that its tenant may take: any below
        its cap, only its own at it. Time-slicing: a busy working set larger than the node is then served in
        turns instead of half of it never. The newcomer takes the leaver's place (main's probation for a protected
        one: protection is earned by a hit there), not the window's: a busy set taking turns in the window would
        keep it in use, and a first request would find no window entry free to make way for it. Not admitted,
        with nothing changed, when none may leave."""
        mine = self.at_cap(tenant)
        victim = next((k for k in over if k in self._segment and (not mine or self._tenant[k] == tenant)), None)
        if victim is None or key in self._segment:
            return Admission(False, [])
        place = self._segment[victim]
        self.remove(victim)
        self.add(key, tenant, Segment.PROBATION if place == Segment.PROTECTED else place)
        self._settle(_with(busy, key))
        return Admission(True, [victim])

    def rebalance(self) -> list[tuple[K, Segment]]:
        """After a rebuild: demote protected entries past the protected segment's size (the capacity fell since
        they were promoted). Returns the entries whose segment changed."""
        moved = []
        limit = self.protected_size()
        while len(self.protected) > limit:
            demoted = next(iter(self.protected))
            self._move(demoted, Segment.PROBATION)
            moved.append((demoted, Segment.PROBATION))
        return moved

    # ------------------------------------------------------------------ the decision

    def _victim(
        self, frequency: Callable[[K], float], busy: Collection[K], newcomer: int | None, *, incoming: K | None = None
    ) -> K | None:
        """The entry to evict for `incoming` (not in the cache yet) of tenant `newcomer`, or to shrink (both
        None). A tenant below its cap takes the best victim of all; one at its cap takes it from its own entries
        or from one-off entries, never from another tenant's recurring entries."""
        if newcomer is not None and self.at_cap(newcomer):
            tenant_of = self._tenant

            def may_leave(key: K) -> bool:
                return tenant_of[key] == newcomer or frequency(key) <= ONE_OFF

            # None when nothing may leave: the request waits until one of the newcomer's own frees.
            return self._choose(frequency, busy, may_leave=may_leave, incoming=incoming)
        return self._choose(frequency, busy, incoming=incoming)

    def at_cap(self, tenant: int) -> bool:
        """Whether one more entry would take `tenant` past its cap (it then makes room only from its own or
        one-off entries): its share of the slots, or an equal share if more, while another tenant holds any."""
        holds, tenants = self.owned.get(tenant, 0), len(self.owned)
        if not holds or tenants < 2:
            return False
        return holds + 1 > max(self._capacity * self.shape.tenant, self._capacity / tenants)

    def _choose(
        self,
        frequency: Callable[[K], float],
        busy: Collection[K],
        *,
        may_leave: Callable[[K], bool] | None = None,
        incoming: K | None,
    ) -> K | None:
        """TinyLFU between the window's overflow and main's victim (among the entries that `may_leave`, when
        given: the window's first of them counts as its overflow). With no window entry free to leave, the
        window's oldest entry still competes for main (busy entries move, they only never leave): asked for more
        often than main's victim, it joins probation and the victim leaves. Otherwise the `incoming` entry stands
        in for the overflow: None (it waits) when main's victim is recurring and asked for at least as often (a
        tenant at its cap makes room from its own or one-off entries without it)."""
        coming = incoming is not None
        overflowing = may_leave is not None or len(self.window) + coming > self._window_size
        candidate = self._first(_WINDOW, busy, may_leave) if overflowing else None
        resident = self._first(_MAIN, busy, may_leave)
        if candidate is None:
            if resident is None:  # main holds nothing that may leave: the window's, if any (not overflowing)
                return self._first(_WINDOW, busy, may_leave)
            if coming and may_leave is None and overflowing:
                asked = frequency(resident)
                # A hot adapter answering all the time would otherwise hold the window for good, and every
                # newcomer would have to out-ask main's victim.
                oldest = next(iter(self.window), None)
                if oldest is not None and frequency(oldest) > asked:
                    self._move(oldest, Segment.PROBATION)
                    return resident
                if asked > ONE_OFF and frequency(incoming) <= asked:
                    return None
            return resident
        if resident is None:
            return candidate
        # The window's overflow is admitted to main only if asked for more often than main's victim.
        if frequency(candidate) > frequency(resident):
            self._move(candidate, Segment.PROBATION)
            return resident
        return candidate

    def _settle(self, busy: Collection[K]) -> None:
        """The window's overflow (entries past its size) joins probation: main has room for it now."""
        limit = self._window_size
        while len(self.window) > limit:
            key = self._first(_WINDOW, busy)
            if key is None:
                return
            self._move(key, Segment.PROBATION)

    def _put(self, key: K, segment: Segment) -> None:
        self._by[segment][key] = None
        self._segment[key] = segment

    def _move(self, key: K, segment: Segment) -> None:
        del self._by[self._segment[key]][key]
        self._put(key, segment)

    def _first(
        self, segments: Sequence[Segment], busy: Collection[K], may_leave: Callable[[K], bool] | None = None
    ) -> K | None:
        """The least recently used entry of the first of `segments` that has one not busy (and that `may_leave`)."""
        for segment in segments:
            for key in self._by[segment]:
                if key not in busy and (may_leave is None or may_leave(key)):
                    return key
        return None


@dataclass(frozen=True)
class Admission(Generic[K]):
    """What a miss did: whether the entry was taken in, and what leaves (to be unloaded) either way."""

    admitted: bool
    evicted: list[K]


def _with(busy: Collection[K], key: K) -> Collection[K]:
    if not busy:
        return (key,)
    if isinstance(busy, (set, frozenset)):
        return busy | {key}
    return (*busy, key)


def choose_node(
    order: Sequence[N],
    *,
    free: Callable[[N], int],
    on_disk: Callable[[N], bool] = lambda node: False,
    disk_choices: int = 3,
) -> N | None:
    """Where a miss loads: the first node in the revision's preference `order` (rendezvous: its home first) with a
    free slot; else the first of its `disk_choices` best nodes that holds its files on local disk (no fetch from
    the store); else its home, where something is evicted. None without nodes."""
    for node in order:
        if free(node) > 0:
            return node
    for node in order[:disk_choices]:
        if on_disk(node):
            return node
    return order[0] if order else None
