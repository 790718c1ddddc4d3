"""When a cold request that found no room on demand should come back: its `Retry-After`.

A request for a revision loaded nowhere whose node has no entry that may leave (every one busy, loads already
queued beyond those the node runs at once) is refused, not queued: its client comes back after `Retry-After` and
asks again. Coming back too early costs that client one of its retries (the official `openai` client has two);
too late costs it only time. So the estimate is the time the node should have room *for this ask*:

- asks refused before it and still waiting are ahead, in the turns tenants take (`RefusedAsks`: in Redis, per base
  model, one sorted set per tenant with each ask's first refusal as score, shared by every process; an ask whose
  client was not back by the time it was told, and a little more, has given up and leaves): an ask that is
  preceded by r asks of its own tenant goes after those, and after each other tenant's first r and its next one if
  refused earlier, so a tenant that floods cold requests pushes another's estimate back by one ask a turn, not by
  its flood. The k-th ask in that order needs the k-th room (of the rooms a tenant at its cap may take, its own
  entries', only the asks that may take them count: its own and those of tenants below their caps, `competing`;
  while a busy set takes turns, asks ahead beyond this ask's turns also take turns it may not, `place_of`);
- room comes from entries loaded for a request (busy until that request's client comes back for them, at the
  latest `min_resident_s` after they became ready) and from loads under way (the same, once loaded): `frees` is
  when each should be free. Recurring entries in use are not counted (they are likely to be used again), but for
  a recurring ask, the end of their turn (time-slicing: serving/services/residency.py) is;
- loads queued beyond those the node runs at once (`parallel`) drain `parallel` per `load_s`, and every ask
  ahead adds one.

Then its own load. Without enough of either to count on, `min_resident_s` plus a load: by then every entry that
is not in use again has become free. No Django here; no clock but what the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


def room_in_s(
    frees: Iterable[float],
    *,
    ahead: int,
    pending: int,
    parallel: int,
    load_s: float,
    min_resident_s: float,
    quantum_s: float = 0.0,
    theirs: Iterable[float] = (),
) -> float:
    """Seconds until the node should have room for an ask with `ahead` waiting asks before it: the `ahead`-th
    earliest of `frees` (seconds from now, each an entry that will be free by then), and not before the loads
    queued beyond `parallel` (of `pending`) and those of the asks ahead have started. When fewer entries free than
    asks wait: with turns (`quantum_s`, time-slicing), the asks loaded in the rooms before it hold them a turn each,
    so it waits a round more per round of asks ahead; without, `min_resident_s` plus a load. With turns, `theirs`
    are the ends of turns the asks ahead may take and it may not (`place_of`)."""
    ordered = sorted(max(0.0, f) for f in frees)
    place = place_of(ordered, [max(0.0, f) for f in theirs], ahead) if quantum_s else None
    if place is not None:
        index, rounds = place
        room = ordered[index] + rounds * (load_s + quantum_s)
    elif ahead < len(ordered):
        room = ordered[ahead]
    else:
        room = min_resident_s + load_s
    queue = max(0, pending + ahead - parallel) * load_s / max(1, parallel)
    return max(room, queue)


def place_of(mine: Sequence[float], theirs: Sequence[float], ahead: int) -> tuple[int, int] | None:
    """The room an ask gets while a busy set takes turns: (its index in `mine`, rounds later). The k-th ask waiting
    takes the k-th of the turns it may take (`mine`, sorted), as those before it may take them too. Asks before it
    beyond those turns wait for later rounds, and may also take turns it may not (`theirs`, in any order: entries
    asked for much more often than it): they take every turn in the order they end, its own first at the same time, each
    coming round again once taken, and it takes the first of its own after them. Counted over its own turns only,
    every waiting ask made a round of them (benchmarks/long_tail, a busy set's start: an ask with few peers was
    told 294 s for a room it had in 58). In the first round, asks before it take its own turns first: spread there
    too, the thrash phase's asks were told turns the asks before them took (told too early, a third of them ran out
    of retries). None: it may take none."""
    if not mine:
        return None
    if ahead < len(mine):
        return ahead, 0
    turns = sorted([(end, 0, i) for i, end in enumerate(mine)] + [(end, 1, -1) for end in theirs])
    beyond = ahead - len(mine)
    for k in range(beyond, beyond + len(turns)):
        rounds, at = divmod(k, len(turns))
        if turns[at][2] >= 0:
            return turns[at][2], rounds + 1
    return None  # not reached: `mine` holds one at least


# A tenant's asks less those whose client was not back by when it was told (KEYS[2]: each ask's time, as score), and
# those first refused before ARGV[2]; their count. O(log n) per ask that leaves, each leaving once.
_TRIM = """
local late = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
for _, ask in ipairs(late) do redis.call('ZREM', KEYS[1], ask) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
return redis.call('ZCARD', KEYS[1])
"""


class RefusedAsks:
    """The cold requests refused for want of room and still waiting, per base model and tenant, oldest first (Redis).

    An ask's place is kept from its first refusal (a retry does not move it to the back) while its client keeps
    coming back: each refusal tells it when (`expect`), and an ask not asked again by then and `grace_s` more has
    given up (the `openai` client stops after its second retry) and leaves; so does any after `keep_s`, longer than
    a client's retries last. One that is placed, or whose revision becomes ready by another path (an activation, a
    spread), leaves at once. Per base model, a sorted set of the tenants with asks waiting (last refusal as score),
    one of each tenant's asks, and one of when each of those should be asked again by.
    """

    def __init__(self, prefix: str, keep_s: float, grace_s: float = 5.0) -> None:
        self.prefix, self.keep_s, self.grace_s = prefix, keep_s, grace_s

    def _tenants(self, base_model_id: int) -> str:
        return f"{self.prefix}:{base_model_id}"

    def _asks(self, base_model_id: int, tenant_id: int) -> str:
        return f"{self.prefix}:{base_model_id}:t{tenant_id}"

    def _back(self, base_model_id: int, tenant_id: int) -> str:
        return f"{self.prefix}:{base_model_id}:t{tenant_id}:back"

    def _trimmed(self, pipe, base_model_id: int, tenant_id: int, now: float) -> None:
        """Queue on `pipe` the trim of a tenant's asks (those given up or too old); its result is their count.
        EVAL, not a registered script: a pipeline with one asks the server whether it has it, a round trip more."""
        keys = (self._asks(base_model_id, tenant_id), self._back(base_model_id, tenant_id))
        pipe.eval(_TRIM, 2, *keys, now, now - self.keep_s)

    def ahead(self, redis, base_model_id: int, tenant_id: int, revision_id: int, now: float) -> Turn:
        """Record the refusal of `revision_id` (its first time kept) and return the asks that go before it."""
        gone, ttl = now - self.keep_s, int(self.keep_s) + 1
        tenants, own = self._tenants(base_model_id), self._asks(base_model_id, tenant_id)
        pipe = redis.pipeline(transaction=False)
        self._trimmed(pipe, base_model_id, tenant_id, now)  # one back too late has left: it starts again
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
            return Turn(rank, rank, first)
        pipe = redis.pipeline(transaction=False)
        for other in others:  # trimmed (its count), then its ask of this turn: O(log n) each, however many
            self._trimmed(pipe, base_model_id, other, now)
            pipe.zrange(self._asks(base_model_id, other), rank, rank, withscores=True)
        found = pipe.execute()
        counts, asks = found[0::2], found[1::2]
        # Each other tenant's asks of the turns before this one's, and of this turn the one refused before it.
        before = {
            other: min(n, rank) + bool(ask and ask[0][1] < first)
            for other, n, ask in zip(others, counts, asks, strict=True)
        }
        return Turn(rank + sum(before.values()), rank, first, tuple((t, n) for t, n in before.items() if n))

    def expect(self, pipe, base_model_id: int, tenant_id: int, revision_id: int, back_at: float) -> None:
        """Queue on `pipe` that the refused ask's client was told to come back at `back_at` (its latest refusal,
        `ahead`, told it): not asked again by then and `grace_s` more, it has given up and leaves."""
        back = self._back(base_model_id, tenant_id)
        pipe.zadd(back, {str(revision_id): back_at + self.grace_s})
        pipe.expire(back, int(self.keep_s) + 1)

    def waiting(self, redis, base_model_id: int, tenant_id: int, revision_id: int, now: float) -> bool:
        """Whether the ask of `revision_id` still waits: refused within `keep_s`, not placed or given up since."""
        return self.waiting_s(redis, base_model_id, tenant_id, revision_id, now) is not None

    def waiting_s(self, redis, base_model_id: int, tenant_id: int, revision_id: int, now: float) -> float | None:
        """How long the ask of `revision_id` has waited since its first refusal; None: it does not wait."""
        pipe = redis.pipeline(transaction=False)
        pipe.zscore(self._asks(base_model_id, tenant_id), str(revision_id))
        pipe.zscore(self._back(base_model_id, tenant_id), str(revision_id))
        first, back_by = pipe.execute()
        if first is None or float(first) <= now - self.keep_s or (back_by is not None and float(back_by) < now):
            return None
        return now - float(first)

    def forget(self, pipe, base_model_id: int, tenant_id: int, revision_id: int) -> None:
        """Queue on `pipe` that the ask of `revision_id` no longer waits (placed, or told to come back only after it
        would be forgotten anyway)."""
        pipe.zrem(self._asks(base_model_id, tenant_id), str(revision_id))
        pipe.zrem(self._back(base_model_id, tenant_id), str(revision_id))

    def placed(self, redis, base_model_id: int, tenant_id: int, revision_id: int) -> None:
        pipe = redis.pipeline(transaction=False)
        self.forget(pipe, base_model_id, tenant_id, revision_id)
        pipe.execute()


@dataclass(frozen=True)
class Turn:
    """Where a refused ask waits: the asks that go before it (`ahead`), of them its tenant's own (`own`), when it
    was first refused (`first`: it is forgotten `keep_s` after), and the others per tenant (`others`: (tenant id,
    asks) for each tenant with any before it)."""

    ahead: int
    own: int
    first: float = field(default=0.0, compare=False)
    others: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    def competing(self, at_cap: Callable[[int], bool]) -> int:
        """For an ask whose tenant is at its cap (it takes only its own entries), the asks before it that may take
        those too: its own, and those of the tenants not `at_cap` (one at its cap takes only its own as well)."""
        return self.own + sum(n for tenant, n in self.others if not at_cap(tenant))
