"""The gateway's in-process caches: entries that expire on their own clock, reload ahead of it, and are shared
out so that no tenant's traffic evicts another tenant's entries or discards its reloads.

Underneath is cachetools' `TLRUCache`: each entry carries its own expiry (the TTL depends on whether live
events keep the cache fresh, see serving/gateway/feed.py), and a full cache drops its least recently used
entry rather than everything.

Bounds, against a caller who holds a valid key and sends whatever names it likes:

- A cache holds at most `maxsize` entries (MAX_ENTRIES, 10,000).
- Its entries are kept in shares, each a `TLRUCache` of its own: an owner's (for routes and keys, a tenant's)
  found entries, and apart from them its misses (a model name that names nothing, an alias with no live
  revision, a pin of no approved revision). An owner's found entries are at most `per_owner` (TENANT_SHARE,
  2,500 for routes) and its misses at most `misses_per_owner` (TENANT_MISSES, 200 for routes): a full share
  drops its own least recently used entry, so a flood of one tenant's random model names or `@rN` pins only
  ever evicts that tenant's misses, and a flood of its real routes or keys only that tenant's entries.
- Only when the whole cache is full (many owners busy at once) does a new entry make room outside its own
  share: the share used least recently gives up its least recently used entry. One owner alone holds at
  most `per_owner + misses_per_owner` entries (2,700 of 10,000), so it cannot fill the cache by itself.

Reloads and drops: an entry past half its TTL is reloaded beside the request that reads it, and a miss is
read on the request path; either may read state older than a drop (a live event, a node's 404) that lands
while it reads, and is then not kept. A drop concerns only what it dropped and what matches it (one key, one
tenant's routes or keys): a load of another key, or for another tenant, is kept. So one tenant's events
never discard another tenant's reloads. The drops are remembered only while loads are in flight, at most
MAX_DROPS_REMEMBERED of them; a load older than the oldest remembered drop is not kept.

Reads cost a dictionary lookup more than a bare `TLRUCache` (the key's share) and never scan the cache; a
drop scans the shares of the owners it names (all of them when it names none).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachetools import Cache, TLRUCache

if TYPE_CHECKING:
    from serving.gateway.background import Background

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000  # entries in one cache, all owners together
TENANT_SHARE = MAX_ENTRIES // 4  # one tenant's found entries (its routes, its keys)
TENANT_MISSES = MAX_ENTRIES // 50  # one tenant's misses (model names that name nothing)
SHARED_MISSES = MAX_ENTRIES // 10  # misses that belong to no tenant (refusals of tokens, by kind)
MAX_DROPS_REMEMBERED = 1_000  # drops remembered for the loads in flight

Predicate = Callable[[Hashable, Any], bool]
# Whose share an entry counts against: (owner, whether it is a miss).
ShareOf = Callable[[Hashable, Any], tuple[Hashable, bool]]


@dataclass(slots=True)
class _Entry:
    value: Any
    due: float  # from then on, a read starts a background reload
    keep: float  # from then on, the entry is gone (its TTL plus any stale window)


def _no_stale() -> float:
    return 0.0


def _one_share(_key: Hashable, _value: Any) -> tuple[Hashable, bool]:
    return None, False


def _everything(_key: Hashable, _value: Any) -> bool:
    return True


def _keep_until(_key: Hashable, entry: _Entry, _now: float) -> float:
    return entry.keep


class _Share(TLRUCache):
    """One owner's found entries, or its misses: a `TLRUCache` that unindexes what it drops by itself.

    cachetools removes entries on its own in two places, both overridden here: `popitem()` (the least
    recently used entry of a full cache) and `expire()` (entries past their time, on every write).
    """

    def __init__(self, name: tuple[Hashable, bool], maxsize: int, index: dict, timer: Callable[[], float]):
        super().__init__(maxsize, ttu=_keep_until, timer=timer)
        self.name = name
        self._index = index

    def expire(self, time: float | None = None) -> list:
        expired = super().expire(time)
        for key, _entry in expired:
            self._unindex(key)
        return expired

    def popitem(self) -> tuple[Hashable, _Entry]:
        key, entry = super().popitem()
        self._unindex(key)
        return key, entry

    def peek(self, key: Hashable) -> _Entry | None:
        """The entry under `key`, expired or not, without making it the most recently used."""
        try:
            return Cache.__getitem__(self, key)
        except KeyError:
            return None

    def _unindex(self, key: Hashable) -> None:
        if self._index.get(key) is self:
            del self._index[key]


class Loading:
    """A value being read for `key` outside the cache (a miss, a background reload).

    `keep(value)` caches it unless a drop since the read began concerned it (dropped `key`, or matches
    `(key, value)`); `cancel()` ends a read that produced nothing. Either ends it; later calls do nothing.
    """

    __slots__ = ("_cache", "_open", "_started", "key")

    def __init__(self, cache: RefreshingCache, key: Hashable, started: int) -> None:
        self._cache, self.key, self._started, self._open = cache, key, started, True

    def keep(self, value: Any) -> bool:
        """Cache `value` unless a drop since the read began concerned it; True if it was cached."""
        if not self._open:
            return False
        self._open = False
        current = self._cache._untouched_since(self._started, self.key, value)
        self._cache._load_ended(self.key)
        if current:
            self._cache.put(self.key, value)
        return current

    def cancel(self) -> None:
        if self._open:
            self._open = False
            self._cache._load_ended(self.key)


class RefreshingCache:
    """A TTL cache, shared out between owners, whose entries are reloaded in the background before they expire.

    An entry past half its TTL is "due": it is still served, and `refresh_ahead()` reloads it beside the
    request, so a steady stream of requests for a hot key or route never waits on the database. `stale()`
    (seconds) keeps an entry past its TTL, served while it reloads. `share(key, value)` says whose share an
    entry counts against, (owner, is a miss); the module docstring has the bounds. A load (`loading()`,
    `load()`, `refresh_ahead()`) that a drop concerns while it reads is not kept: it may have read older state.

    Used from the event loop only (cachetools' caches are not thread-safe).
    """

    def __init__(
        self,
        background: Background,
        *,
        ttl: Callable[[], float],
        stale: Callable[[], float] = _no_stale,
        maxsize: int = MAX_ENTRIES,
        share: ShareOf = _one_share,
        per_owner: int | None = None,
        misses_per_owner: int | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._background = background
        self._ttl, self._stale, self._timer = ttl, stale, timer
        self._share_of = share
        self.maxsize = maxsize
        self.per_owner = min(maxsize, per_owner or maxsize)
        self.misses_per_owner = min(maxsize, misses_per_owner or self.per_owner)
        self._index: dict[Hashable, _Share] = {}  # every entry's key → the share that holds it
        self._shares: OrderedDict[tuple[Hashable, bool], _Share] = OrderedDict()  # least recently used first
        self._reloading: set[Hashable] = set()  # keys with a background reload under way
        self._loading: Counter[Hashable] = Counter()  # loads in flight per key
        self._stamp = 0  # drops so far
        self._drops: deque[tuple[int, Predicate | None, frozenset]] = deque()  # (stamp, matches, keys loading)
        self._forgotten = 0  # the stamp of the newest drop no longer remembered

    # -- reads and writes ------------------------------------------------------------------------

    def get(self, key: Hashable) -> tuple[bool, Any]:
        """(True, value) for an entry still kept, else (False, None)."""
        share = self._index.get(key)
        if share is not None:
            entry = share.get(key)
            if entry is not None:
                self._shares.move_to_end(share.name)
                return True, entry.value
        return False, None

    def put(self, key: Hashable, value: Any) -> None:
        now, ttl = self._timer(), self._ttl()
        keep = now + ttl + self._stale()
        name = self._share_of(key, value)
        held = self._index.get(key)
        if held is not None and (keep <= now or held.name != name):
            self._discard(key)  # a miss that is found now (or the reverse) changes share
            held = None
        if keep <= now:  # a TTL of 0: nothing is kept
            return
        share = self._shares.get(name) if held is not None else self._make_room(name)
        if share is None:
            share = self._shares[name] = _Share(name, self._bound(name), self._index, self._timer)
        else:
            self._shares.move_to_end(name)
        share[key] = _Entry(value, now + ttl / 2, keep)
        if Cache.__contains__(share, key):
            self._index[key] = share
        elif self._index.get(key) is share:  # already past its time by the share's clock: not stored
            del self._index[key]

    def _bound(self, name: tuple[Hashable, bool]) -> int:
        return self.misses_per_owner if name[1] else self.per_owner

    def _make_room(self, name: tuple[Hashable, bool]) -> _Share | None:
        """Before a new entry goes into share `name`: a full share drops its own least recently used entry
        (when it is stored); otherwise, with the whole cache full, the share used least recently gives up its
        least recently used one. Returns the share, if it exists."""
        share = self._shares.get(name)
        if share is not None:
            share.expire()
            if len(share) >= share.maxsize:
                return share
        while len(self._index) >= self.maxsize and self._shares:
            oldest = next(iter(self._shares.values()))
            with contextlib.suppress(KeyError):  # KeyError: all it held had expired (and expire() took it)
                oldest.popitem()
            if not len(oldest):
                del self._shares[oldest.name]
        return self._shares.get(name)

    def _discard(self, key: Hashable) -> None:
        share = self._index.pop(key, None)
        if share is None:
            return
        with contextlib.suppress(KeyError):  # KeyError: it had expired; TLRUCache removes it all the same
            del share[key]
        if not len(share) and self._shares.get(share.name) is share:
            del self._shares[share.name]

    # -- drops -----------------------------------------------------------------------------------

    def pop(self, key: Hashable) -> None:
        """Drop one entry; a load of it under way is not kept."""
        self._discard(key)
        self._dropped(None, (key,))

    def drop_where(self, predicate: Predicate, *, owners: Iterable[Hashable] | None = None) -> list[Hashable]:
        """Drop every entry whose (key, value) matches, among those of `owners` (every owner's without).

        A load under way of a dropped key, or whose (key, value) matches, is not kept. `predicate` must say
        on its own what the drop concerns: `owners` only narrows which shares are scanned. Returns the keys.
        """
        if owners is None:
            shares = list(self._shares.values())
        else:
            shares = [s for o in set(owners) for miss in (False, True) if (s := self._shares.get((o, miss)))]
        dropped = []
        for share in shares:
            for key in list(share):  # unexpired keys, oldest first; peeking leaves their order alone
                entry = share.peek(key)
                if entry is not None and predicate(key, entry.value):
                    dropped.append(key)
        for key in dropped:
            self._discard(key)
        self._dropped(predicate, dropped)
        return dropped

    def clear(self) -> None:
        """Drop everything; no load under way is kept."""
        self._index.clear()
        self._shares.clear()
        self._dropped(_everything, ())

    def _dropped(self, predicate: Predicate | None, keys: Iterable[Hashable]) -> None:
        self._stamp += 1
        if not self._loading:
            return  # nothing in flight that this drop could concern
        loading = frozenset(key for key in keys if key in self._loading)
        if predicate is None and not loading:
            return
        self._drops.append((self._stamp, predicate, loading))
        if len(self._drops) > MAX_DROPS_REMEMBERED:
            self._forgotten = self._drops.popleft()[0]

    # -- loads -----------------------------------------------------------------------------------

    def loading(self, key: Hashable) -> Loading:
        """Start reading `key` outside the cache; hand the value to `Loading.keep()` (see `Loading`)."""
        self._loading[key] += 1
        return Loading(self, key, self._stamp)

    async def load(self, key: Hashable, read: Callable[[], Awaitable[Any]]) -> Any:
        """Read a missing entry with `read()`: returned, and kept unless a drop concerned it meanwhile."""
        loading = self.loading(key)
        try:
            value = await read()
        except BaseException:
            loading.cancel()
            raise
        loading.keep(value)
        return value

    def refresh_ahead(self, key: Hashable, load: Callable[[], Awaitable[Any]]) -> None:
        """Reload a due entry in the background, one reload per key at a time; the caller uses the cached one."""
        share = self._index.get(key)
        entry = share.peek(key) if share is not None else None
        if entry is None or entry.due > self._timer() or key in self._reloading:
            return
        self._reloading.add(key)
        loading = self.loading(key)

        async def reload() -> None:
            try:
                loading.keep(await load())
            except Exception:
                log.warning("gateway: background refresh of %r failed; it expires as usual", key, exc_info=True)
            finally:
                loading.cancel()
                self._reloading.discard(key)

        self._background.spawn(reload(), name="gateway cache refresh")

    def _untouched_since(self, started: int, key: Hashable, value: Any) -> bool:
        if self._forgotten > started:
            return False  # a drop since the start is no longer remembered: it may have concerned this
        for stamp, predicate, keys in reversed(self._drops):
            if stamp <= started:
                break
            if key in keys or (predicate is not None and predicate(key, value)):
                return False
        return True

    def _load_ended(self, key: Hashable) -> None:
        self._loading[key] -= 1
        if self._loading[key] <= 0:
            del self._loading[key]
        if not self._loading:
            self._drops.clear()

    # -- inspection ------------------------------------------------------------------------------

    def cached_keys(self) -> list[Hashable]:
        return [key for share in self._shares.values() for key in share]

    def held(self, owner: Hashable) -> tuple[int, int]:
        """How many entries `owner` holds: (found, misses)."""
        found, misses = (self._shares.get((owner, miss)) for miss in (False, True))
        return len(found or ()), len(misses or ())

    def __len__(self) -> int:
        return len(self._index)
