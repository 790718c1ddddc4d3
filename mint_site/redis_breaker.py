"""Leave Redis alone for a few seconds after it failed, then try it again.

Whatever can go on without Redis for a while (the gateway's shared counters, the failed-authentication counts)
keeps a `RedisBreaker`, so that a dead or unreachable Redis costs one timeout per pause, not one per request
or per sync.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# What a Redis call raises when Redis is down, unreachable or too slow.
REDIS_DOWN = (TimeoutError, RedisError, OSError)


class RedisBreaker:
    """Open for `pause_s` after each `trip`: while open, its owner does without Redis (`meanwhile` says how)."""

    def __init__(self, what: str, *, meanwhile: str, pause_s: float = 5.0) -> None:
        self.what, self.meanwhile, self.pause_s = what, meanwhile, pause_s
        self._until = 0.0

    @property
    def open(self) -> bool:
        return time.monotonic() < self._until

    def trip(self, exc: BaseException) -> None:
        """Redis failed (`exc`): do not try it again for `pause_s`."""
        self._until = time.monotonic() + self.pause_s
        log.warning("%s: Redis unavailable (%s); %s for %.0f s", self.what, exc, self.meanwhile, self.pause_s)
