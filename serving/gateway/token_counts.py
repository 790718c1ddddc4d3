"""The token counters of serving/gateway/budgets.py as one process knows them, the reservation an admitted
request holds on them, and the Lua script that syncs them with Redis."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.services.budgets import WINDOW_S, Period

# KEYS: counters. ARGV[3i-2]: tokens to add to KEYS[i]; ARGV[3i-1]: 1 creates it when absent (a minute's window),
# 0 leaves an absent one absent (a month's, rebuilt from the database first); ARGV[3i]: its lifetime in seconds,
# set when it has none. Returns each counter's total, or -1 for an absent month.
SYNC_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  local add, create, ttl = tonumber(ARGV[3 * i - 2]), ARGV[3 * i - 1] == '1', tonumber(ARGV[3 * i])
  if create or redis.call('EXISTS', key) == 1 then
    out[i] = redis.call('INCRBY', key, add)
    if redis.call('TTL', key) < 0 then
      redis.call('EXPIRE', key, ttl)
    end
  else
    out[i] = -1
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Reservation:
    """What an admitted request added to its limited counters (`TokenLimits.admit`), settled when it ends."""

    tokens: int
    counts: tuple[Count, ...]


@dataclass(eq=False, slots=True)
class Count:
    """One counter as this process knows it: a tenant's or a key's tokens in a minute window or a month."""

    redis_key: str
    tenant_id: int
    key_id: int | None  # None: the tenant's
    period: Period
    month: bool
    known: int = 0  # the total across processes, as of the last sync
    pending: int = 0  # this process's tokens not yet added in Redis
    reserved: int = 0  # what this process's requests in flight may still cost (never sent to Redis)
    read_at: float = -math.inf  # when Redis last reported the total (monotonic)
    used_at: float = 0.0  # when a request last checked or spent on it (monotonic)
    budget: int = 0  # month: the budget it was last checked against (0: none; kept only while Redis has it)
    key_prefix: str = ""
    absent: bool = False  # month: Redis had no such counter at the last sync
    seeding: bool = False  # month: being rebuilt from the database
    seed_after: float = 0.0  # month: no rebuild before (monotonic), after one failed
    crossed: set[tuple[int, int]] = field(default_factory=set)  # (budget, threshold) whose event was asked for

    @property
    def used(self) -> int:
        """The tokens counted: as Redis last reported them, and this process's not sent yet."""
        return self.known + self.pending

    @property
    def total(self) -> int:
        """What a request is admitted against: the tokens counted, and those reserved by requests in flight."""
        return self.known + self.pending + self.reserved

    def ttl(self, now: float) -> int:
        if not self.month:
            return 2 * WINDOW_S
        return max(WINDOW_S, int(self.period.month_end.timestamp() - now) + 86400)
