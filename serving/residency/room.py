"""When a cold request that found no room on demand should come back: its `Retry-After`.

A request for a revision loaded nowhere whose node has no entry that may leave (every one busy, loads already
queued beyond those the node runs at once) is refused, not queued: its client comes back after `Retry-After` and
asks again. Coming back too early costs that client one of its retries (the official `openai` client has two);
too late costs it only time. So the estimate is the time the node should have room *for this ask*:

- asks refused before it and still waiting are ahead (`RefusedAsks`: one sorted set per base model in Redis,
  the first refusal's time as score, shared by every process): the k-th waiting ask needs the k-th room;
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


class RefusedAsks:
    """The cold requests refused for want of room and still waiting, per base model, oldest first (Redis).

    An ask's place is kept from its first refusal (a retry does not move it to the back) for `keep_s`, longer
    than a client's retries last; one that is placed leaves at once.
    """

    def __init__(self, prefix: str, keep_s: float) -> None:
        self.prefix, self.keep_s = prefix, keep_s

    def _key(self, base_model_id: int) -> str:
        return f"{self.prefix}:{base_model_id}"

    def ahead(self, redis, base_model_id: int, revision_id: int, now: float) -> int:
        """Record the refusal of `revision_id` (its first time kept) and return how many asks wait before it."""
        key = self._key(base_model_id)
        pipe = redis.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now - self.keep_s)
        pipe.zadd(key, {str(revision_id): now}, nx=True)
        pipe.zrank(key, str(revision_id))
        pipe.expire(key, int(self.keep_s) + 1)
        rank = pipe.execute()[-2]
        return int(rank or 0)

    def placed(self, redis, base_model_id: int, revision_id: int) -> None:
        redis.zrem(self._key(base_model_id), str(revision_id))
