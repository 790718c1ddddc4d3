"""When a cold request that found no room on demand should come back: its `Retry-After`.

A request for a revision loaded nowhere whose node has no entry that may leave (every one busy, loads already
queued beyond those the node runs at once) is refused, not queued: its client comes back after `Retry-After` and
asks again. Coming back too early costs that client one of its retries (the official `openai` client has two);
too late costs it only time. So the estimate is the time the node should have room *for this ask*:

- asks refused before it and still waiting are ahead, in the turns tenants take (`RefusedAsks`: in Redis, per base
  model, one sorted set per tenant with each ask's first refusal as score, shared by every process; an ask whose
  client is not back by when it was told to come back is gone): an ask that is
  preceded by r asks of its own tenant goes after those, and after each other tenant's first r and its next one if
  refused earlier, so a tenant that floods cold requests pushes another's estimate back by one ask a turn, not by
  its flood. The k-th ask in that order needs the k-th room;
- room comes from entries loaded for a request (busy until that request's client comes back for them, at the
  latest `min_resident_s` after they became ready) and from loads under way (the same, once loaded): `frees` is
  when each should be free. Recurring entries in use are not counted: they are likely to be used again;
- loads queued beyond those the node runs at once (`parallel`) drain `parallel` per `load_s`, and every ask
  ahead adds one.

Then its own load. Without enough of either to count on, `min_resident_s` plus a load: by then every entry that
is not in use again has become free. No Django here; no clock but what the caller passes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def room_in_s(
    frees: Iterable[float],
    *,
    ahead: int,
    pending: int,
    parallel: int,
    load_s: float,
    min_resident_s: float,
) -> float:
    """Seconds until the node should have room for an ask with `ahead` waiting asks before it: the `ahead`-th
    earliest of `frees` (seconds from now, each an entry that will be free by then), and not before the loads
    queued beyond `parallel` (of `pending`) and those of the asks ahead have started. `min_resident_s` plus a load
    when fewer entries free than asks wait."""
    ordered = sorted(max(0.0, f) for f in frees)
    room = ordered[ahead] if ahead < len(ordered) else min_resident_s + load_s
    queue = max(0, pending + ahead - parallel) * load_s / max(1, parallel)
    return max(room, queue)


# Trims one tenant's asks (KEYS[1], first refusal as score) of those whose client is not back by when it should be
# (KEYS[2], that time as score: ARGV[1] is now) and of those first refused before ARGV[2]; returns how many are left.
_TRIM = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
for i = 1, #stale, 256 do
  local part = {unpack(stale, i, math.min(i + 255, #stale))}
  redis.call('ZREM', KEYS[1], unpack(part))
  redis.call('ZREM', KEYS[2], unpack(part))
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
return redis.call('ZCARD', KEYS[1])
"""


class RefusedAsks:
    """The cold requests refused for want of room and still waiting, per base model and tenant, oldest first (Redis).

    An ask's place is kept from its first refusal (a retry does not move it to the back) until it is placed, or
    its client is not back by when it was told to come back (`expect`) plus `slack_s`: that client gave up, and
    its ask would hold the others back for nothing. At most `keep_s` in any case. Per base model, a sorted set of
    the tenants with asks waiting (last refusal as score), and per tenant one of its asks and one of when each
    should be asked again.
    """

    def __init__(self, prefix: str, keep_s: float, slack_s: float = 3.0) -> None:
        self.prefix, self.keep_s, self.slack_s = prefix, keep_s, slack_s

    def _tenants(self, base_model_id: int) -> str:
        return f"{self.prefix}:{base_model_id}"

    def _asks(self, base_model_id: int, tenant_id: int) -> tuple[str, str]:
        key = f"{self.prefix}:{base_model_id}:t{tenant_id}"
        return key, f"{key}:due"

    def _trim(self, pipe, base_model_id: int, tenant_id: int, now: float) -> None:
        pipe.eval(_TRIM, 2, *self._asks(base_model_id, tenant_id), now, now - self.keep_s)

    def ahead(self, redis, base_model_id: int, tenant_id: int, revision_id: int, now: float) -> Turn:
        """Record the refusal of `revision_id` (its first time kept) and return the asks that go before it."""
        gone, ttl = now - self.keep_s, int(self.keep_s) + 1
        tenants, own = self._tenants(base_model_id), self._asks(base_model_id, tenant_id)[0]
        pipe = redis.pipeline(transaction=False)
        self._trim(pipe, base_model_id, tenant_id, now)
        pipe.zadd(own, {str(revision_id): now}, nx=True)
        pipe.zrank(own, str(revision_id))
        pipe.zscore(own, str(revision_id))
        pipe.expire(own, ttl)
        pipe.zadd(tenants, {str(tenant_id): now})
        pipe.zremrangebyscore(tenants, "-inf", gone)
        pipe.zrange(tenants, 0, -1)
        pipe.expire(tenants, ttl)
        found = pipe.execute()
        rank, first = int(found[2] or 0), float(found[3] or now)
        others = [int(t) for t in found[7] if int(t) != tenant_id]
        if not others:
            return Turn(rank, rank)
        pipe = redis.pipeline(transaction=False)
        for other in others:  # trimmed (its count), then its ask of this turn: O(log n) each, however many
            self._trim(pipe, base_model_id, other, now)
            pipe.zrange(self._asks(base_model_id, other)[0], rank, rank, withscores=True)
        found = pipe.execute()
        counts, asks = found[0::2], found[1::2]
        # Each other tenant's asks of the turns before this one's, and of this turn the one refused before it.
        before = sum(min(n, rank) + bool(ask and ask[0][1] < first) for n, ask in zip(counts, asks, strict=True))
        return Turn(rank + before, rank)

    def expect(self, redis, base_model_id: int, tenant_id: int, revision_id: int, back_at: float) -> None:
        """The refused ask's client was told to come back at `back_at`: its place is kept until `slack_s` after."""
        due = self._asks(base_model_id, tenant_id)[1]
        pipe = redis.pipeline(transaction=False)
        pipe.zadd(due, {str(revision_id): back_at + self.slack_s})
        pipe.expire(due, int(self.keep_s) + 1)
        pipe.execute()

    def older(self, redis, base_model_id: int, tenant_id: int, revision_id: int, now: float) -> int:
        """How many of the tenant's asks still waiting were refused before `revision_id` (all of them, when it was
        never refused)."""
        own = self._asks(base_model_id, tenant_id)[0]
        pipe = redis.pipeline(transaction=False)
        self._trim(pipe, base_model_id, tenant_id, now)
        pipe.zrank(own, str(revision_id))
        waiting, rank = pipe.execute()
        return int(waiting) if rank is None else int(rank)

    def placed(self, redis, base_model_id: int, tenant_id: int, revision_id: int) -> None:
        pipe = redis.pipeline(transaction=False)
        for key in self._asks(base_model_id, tenant_id):
            pipe.zrem(key, str(revision_id))
        pipe.execute()


@dataclass(frozen=True)
class Turn:
    """Where a refused ask waits: the asks that go before it (`ahead`), and of them its tenant's own (`own`)."""

    ahead: int
    own: int
