"""Usage timestamps in batches: `Placement.last_used_at` (eviction is LRU on it) and `ApiKey.last_used_at`.

The request path only writes into a dict; a background task flushes it at most every
MINT_GATEWAY_USAGE_FLUSH_S with one UPDATE per model (a CASE over the ids, in chunks),
however many requests came in. A process that dies loses at most one interval of
timestamps, which only makes eviction a little less exact.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.db.models import Case, DateTimeField, Q, Value, When
from django.utils import timezone

from serving.gateway import spawn
from serving.models import Placement
from tenants.models import ApiKey

log = logging.getLogger(__name__)

_CHUNK = 500  # ids per UPDATE: keeps each statement (and its CASE) a reasonable size

_lock = threading.Lock()  # the flush runs in a worker thread while requests keep recording
_placements: dict[int, datetime] = {}
_keys: dict[int, datetime] = {}
_key_recorded: dict[int, datetime] = {}  # when each key's use was last queued, to queue it once per interval
_last_flush = time.monotonic()
_flushing = False


def flush_interval() -> float:
    return float(getattr(settings, "MINT_GATEWAY_USAGE_FLUSH_S", 10.0))


def _key_interval() -> timedelta:
    return timedelta(seconds=getattr(settings, "MINT_KEY_TOUCH_INTERVAL_S", 60))


def record(*, placement_id: int | None = None, key_id: int | None = None, at: datetime | None = None) -> None:
    """Note a use, in memory only; `maybe_flush()` (once per request, at its end) writes it later."""
    at = at or timezone.now()
    with _lock:
        if placement_id is not None and (placement_id not in _placements or _placements[placement_id] < at):
            _placements[placement_id] = at
        if key_id is not None:
            last = _key_recorded.get(key_id)
            if last is None or at - last >= _key_interval():
                _key_recorded[key_id] = at
                _keys[key_id] = at


def maybe_flush() -> None:
    """Schedule a flush on the running loop if the interval has passed and none is running."""
    global _flushing, _last_flush
    with _lock:
        if _flushing or time.monotonic() - _last_flush < flush_interval() or not (_placements or _keys):
            return
        _flushing = True
        _last_flush = time.monotonic()
    spawn(sync_to_async(_flush_in_thread, thread_sensitive=False)(), name="gateway usage flush")


def _flush_in_thread() -> None:
    global _flushing
    try:
        flush()
    except Exception:  # noqa: S110  (flush() logged it and kept the timestamps)
        pass
    finally:
        with _lock:
            _flushing = False
        # A pool thread outside any request: close its connection now, or CONN_MAX_AGE would keep it open there.
        connections.close_all()


def flush() -> int:
    """Write every pending timestamp now. Returns the number of UPDATE statements it ran."""
    with _lock:
        placements, keys = dict(_placements), dict(_keys)
        _placements.clear()
        _keys.clear()
    statements = 0
    try:
        statements += _write(Placement, placements, Q())
        stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=timezone.now() - _key_interval())
        statements += _write(ApiKey, keys, stale)
    except Exception:
        log.exception("gateway usage flush failed; keeping %d timestamps for the next one", len(placements) + len(keys))
        with _lock:
            for pending, lost in ((_placements, placements), (_keys, keys)):
                for id_, at in lost.items():
                    if id_ not in pending or pending[id_] < at:
                        pending[id_] = at
        raise
    return statements


def _write(model, times: dict[int, datetime], condition: Q) -> int:
    """`UPDATE … SET last_used_at = CASE id WHEN … END WHERE id IN (…)`, one statement per chunk of ids."""
    ids = sorted(times)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        value = Case(*(When(id=i, then=Value(times[i])) for i in chunk), output_field=DateTimeField())
        model.objects.filter(condition, id__in=chunk).update(last_used_at=value)
    return -(-len(ids) // _CHUNK)


def clear() -> None:
    """Drop pending timestamps and reset the flush clock (tests)."""
    global _last_flush, _flushing
    with _lock:
        _placements.clear()
        _keys.clear()
        _key_recorded.clear()
        _last_flush = time.monotonic()
        _flushing = False
