"""The gateway's in-process caches: entries that expire on their own clock and reload ahead of it.

Underneath is cachetools' `TLRUCache`: each entry carries its own expiry (the TTL depends on whether live
events keep the cache fresh, see serving/gateway/feed.py), and a full cache drops its least recently used
entry rather than everything. The bound keeps a flood of random tokens or model names from growing memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachetools import TLRUCache

if TYPE_CHECKING:
    from serving.gateway.state import Background

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000


@dataclass(slots=True)
class _Entry:
    value: Any
    due: float  # from then on, a read starts a background reload
    keep: float  # from then on, the entry is gone (its TTL plus any stale window)


def _no_stale() -> float:
    return 0.0


class RefreshingCache:
    """A TTL cache whose entries are reloaded in the background before they expire.

    An entry past half its TTL is "due": it is still served, and `refresh_ahead()` reloads it beside the
    request, so a steady stream of requests for a hot key or route never waits on the database. `stale()`
    (seconds) keeps an entry past its TTL, served while it reloads. Dropping entries bumps `epoch`, and a
    background reload that started before a drop is discarded: it may have read older state.

    Used from the event loop only (cachetools' caches are not thread-safe).
    """

    def __init__(
        self,
        background: Background,
        *,
        ttl: Callable[[], float],
        stale: Callable[[], float] = _no_stale,
        maxsize: int = MAX_ENTRIES,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._background = background
        self._ttl, self._stale, self._timer = ttl, stale, timer
        self._entries: TLRUCache = TLRUCache(maxsize, ttu=lambda _key, entry, _now: entry.keep, timer=timer)
        self._reloading: set[Hashable] = set()
        self.epoch = 0

    def get(self, key: Hashable) -> tuple[bool, Any]:
        """(True, value) for an entry still kept, else (False, None)."""
        entry = self._entries.get(key)
        return (False, None) if entry is None else (True, entry.value)

    def put(self, key: Hashable, value: Any) -> None:
        now, ttl = self._timer(), self._ttl()
        keep = now + ttl + self._stale()
        if keep <= now:  # a TTL of 0: nothing is kept
            self._entries.pop(key, None)
            return
        self._entries[key] = _Entry(value, now + ttl / 2, keep)

    def pop(self, key: Hashable) -> None:
        self._entries.pop(key, None)
        self.epoch += 1

    def drop_where(self, predicate: Callable[[Hashable, Any], bool]) -> list[Hashable]:
        """Drop every entry whose (key, value) matches; a reload already under way is discarded. Returns the keys."""
        dropped = [key for key, entry in list(self._entries.items()) if predicate(key, entry.value)]
        for key in dropped:
            self._entries.pop(key, None)
        self.epoch += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._reloading.clear()
        self.epoch += 1

    def cached_keys(self) -> list[Hashable]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def refresh_ahead(self, key: Hashable, load: Callable[[], Awaitable[Any]]) -> None:
        """Reload a due entry in the background, one reload per key at a time; the caller uses the cached one."""
        entry = self._entries.get(key)
        if entry is None or entry.due > self._timer() or key in self._reloading:
            return
        self._reloading.add(key)
        epoch = self.epoch

        async def reload() -> None:
            try:
                value = await load()
                if self.epoch == epoch:
                    self.put(key, value)
            except Exception:
                log.warning("gateway: background refresh of %r failed; it expires as usual", key, exc_info=True)
            finally:
                self._reloading.discard(key)

        self._background.spawn(reload(), name="gateway cache refresh")
