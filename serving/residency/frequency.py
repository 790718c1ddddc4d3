"""How often each revision was asked for lately: TinyLFU's frequency with aging, by periods.

A revision's estimate is its requests in the current period plus those of the previous one, so what was asked for
more than two periods ago is forgotten (TinyLFU halves its counters every sample period; two rolling periods age
the same way and need no pass over every counter). `LocalCounts` keeps them in memory, with the period counted in
whatever clock its caller advances (requests in a trace, seconds in a test). `SharedCounts` keeps them in Redis,
one hash per period, shared by every process: gateways add their batched counts (HINCRBY, one pipeline per
flush), the control plane reads the few it compares at an eviction (HMGET of two hashes). `in_last_period` reads
the same hashes as a sliding window, for a rate over a short period. No Django here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from typing import Any


class LocalCounts:
    """Requests per key in the current and the previous period, in memory."""

    __slots__ = ("_current", "_epoch", "_previous", "period")

    def __init__(self, period: float) -> None:
        if period <= 0:
            raise ValueError("period must be positive")
        self.period = period
        self._epoch = 0
        self._current: Counter[Hashable] = Counter()
        self._previous: Counter[Hashable] = Counter()

    def advance(self, now: float) -> None:
        """Move the clock to `now` (in the caller's unit): a period gone by makes the current one previous."""
        epoch = int(now // self.period)
        if epoch == self._epoch:
            return
        self._previous = self._current if epoch == self._epoch + 1 else Counter()
        self._current = Counter()
        self._epoch = epoch

    def record(self, key: Hashable, n: int = 1) -> None:
        self._current[key] += n

    def estimate(self, key: Hashable) -> int:
        return self._current.get(key, 0) + self._previous.get(key, 0)

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())


class SharedCounts:
    """The same counts in Redis: hash `<prefix>:<epoch>` of key → requests, expiring after three periods."""

    def __init__(self, prefix: str, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self.prefix, self.period_s = prefix, period_s

    def _key(self, epoch: int) -> str:
        return f"{self.prefix}:{epoch}"

    def add(self, pipe: Any, counts: Mapping[Hashable, int], now: float) -> None:
        """Queue the increments on a Redis pipeline (sync or asyncio: the caller executes it)."""
        if not counts:
            return
        key = self._key(int(now // self.period_s))
        for member, n in counts.items():
            pipe.hincrby(key, str(member), n)
        pipe.expire(key, int(self.period_s * 3) + 1)

    def estimates(self, client: Any, keys: Iterable[Hashable], now: float) -> dict[Hashable, int]:
        """Each key's requests in the current and previous periods (a sync Redis client; two HMGETs at once)."""
        return {m: c + p for m, (c, p) in self._read(client, keys, now).items()}

    def in_last_period(self, client: Any, keys: Iterable[Hashable], now: float) -> dict[Hashable, float]:
        """Each key's requests in the last `period_s` seconds, as a sliding window: the current period's and the
        share of the previous one's that falls inside it (requests spread evenly over a period)."""
        outside = (now % self.period_s) / self.period_s  # of the previous period, already out of the window
        return {m: c + p * (1.0 - outside) for m, (c, p) in self._read(client, keys, now).items()}

    def _read(self, client: Any, keys: Iterable[Hashable], now: float) -> dict[Hashable, tuple[int, int]]:
        members = list(dict.fromkeys(keys))
        if not members:
            return {}
        epoch = int(now // self.period_s)
        fields = [str(m) for m in members]
        pipe = client.pipeline(transaction=False)
        pipe.hmget(self._key(epoch), fields)
        pipe.hmget(self._key(epoch - 1), fields)
        current, previous = pipe.execute()
        return {m: (int(c or 0), int(p or 0)) for m, c, p in zip(members, current, previous, strict=True)}
