"""`pytest -n N -p tests.parallel`: each pytest-xdist worker gets a Redis database of its own.

Loaded by `-p` before pytest-django reads the settings, so the worker's REDIS_URL (the cache, Channels, the API
throttles and the gateway's counters) is set in time: REDIS_URL's database plus one plus the worker's number
(gw0 → 1 past it). PostgreSQL needs nothing here: pytest-django gives each worker its own test database.
Without xdist this does nothing.
"""

from __future__ import annotations

import os

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    _base, _, _db = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rpartition("/")
    os.environ["REDIS_URL"] = f"{_base}/{int(_db or 0) + 1 + int(_worker[2:])}"
