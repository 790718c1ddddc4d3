"""Usage timestamps in batches: `Placement.last_used_at` (eviction is LRU on it) and `ApiKey.last_used_at`.

The request path only writes into a dict; a background task flushes it with one UPDATE per model (a CASE over
the ids, in chunks), however many requests came in: at most every MINT_RESIDENCY_FLUSH_S (1 s) while placements
were used, else every MINT_GATEWAY_USAGE_FLUSH_S. Placements go fast because the residency policy reads them: an
entry loaded for a request is kept until that request's client comes back for it (serving/services/residency.py),
so the sooner the control plane sees the use, the sooner a one-off entry's slot turns over (at the 10 s of
MINT_GATEWAY_USAGE_FLUSH_S, every entry loaded on demand looked unserved for its whole minimum residency). Keys
are written by their own app's service (`tenants.services.api_keys_touch`, the one writer of
`ApiKey.last_used_at`), with the same once-per-interval rule as REST requests (`tenants.keys.touch_due`). A
process that dies loses at most one interval of timestamps, which only makes eviction a little less exact.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING

from cachetools import LRUCache
from django.conf import settings
from django.utils import timezone

from serving.gateway.caches import MAX_ENTRIES
from serving.services.residency import placements_touch
from tenants import services as tenant_services
from tenants.keys import touch_due

if TYPE_CHECKING:
    from serving.gateway.background import Background, DatabaseThreads

log = logging.getLogger(__name__)


def flush_interval(*, placements: bool = False) -> float:
    """Seconds between flushes: with placement uses pending, at most MINT_RESIDENCY_FLUSH_S."""
    usage = float(settings.MINT_GATEWAY_USAGE_FLUSH_S)
    return min(usage, float(settings.MINT_RESIDENCY_FLUSH_S)) if placements else usage


class Usage:
    """Pending timestamps, recorded on the event loop and written from a database thread."""

    def __init__(self, background: Background, db: DatabaseThreads) -> None:
        self._background, self._db = background, db
        self._lock = threading.Lock()  # the flush runs in a database thread while requests keep recording
        self._placements: dict[int, datetime] = {}
        self._keys: dict[int, datetime] = {}
        # When each key's use was last queued, to queue it once per interval; bounded like the caches.
        self._key_recorded: LRUCache = LRUCache(MAX_ENTRIES)
        self._last_flush = time.monotonic()
        self._flushing = False

    def record(self, *, placement_id: int | None = None, key_id: int | None = None, at: datetime | None = None) -> None:
        """Note a use, in memory only; `maybe_flush()` (once per request, at its end) writes it later."""
        at = at or timezone.now()
        with self._lock:
            if placement_id is not None and (
                placement_id not in self._placements or self._placements[placement_id] < at
            ):
                self._placements[placement_id] = at
            if key_id is not None and touch_due(
                self._key_recorded.get(key_id), at, tenant_services.key_touch_interval()
            ):
                self._key_recorded[key_id] = at
                self._keys[key_id] = at

    def maybe_flush(self) -> None:
        """Schedule a flush on the running loop if the interval has passed and none is running."""
        with self._lock:
            if (
                self._flushing
                or time.monotonic() - self._last_flush < flush_interval(placements=bool(self._placements))
                or not (self._placements or self._keys)
            ):
                return
            self._flushing = True
            self._last_flush = time.monotonic()
        self._background.spawn(self._db.run(self._flush_in_thread), name="gateway usage flush")

    def _flush_in_thread(self) -> None:
        try:
            self.flush()
        except Exception:  # noqa: S110  (flush() logged it and kept the timestamps)
            pass
        finally:
            with self._lock:
                self._flushing = False

    def flush(self) -> int:
        """Write every pending timestamp now (in a thread that may use the ORM). Returns how many rows it wrote."""
        with self._lock:
            placements, keys = dict(self._placements), dict(self._keys)
            self._placements.clear()
            self._keys.clear()
        try:
            return placements_touch(used=placements) + (tenant_services.api_keys_touch(used=keys) if keys else 0)
        except Exception:
            log.exception(
                "gateway usage flush failed; keeping %d timestamps for the next one", len(placements) + len(keys)
            )
            with self._lock:
                for pending, lost in ((self._placements, placements), (self._keys, keys)):
                    for id_, at in lost.items():
                        if id_ not in pending or pending[id_] < at:
                            pending[id_] = at
            raise
