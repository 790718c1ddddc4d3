"""The gateway's side of a canary (serving/services/canary.py): which arm a request goes to, and its counters.

The split: a request for an alias with a canary goes to the candidate when a hash of the caller's `user` field
falls under the canary's percent, so one user stays on one arm for the whole canary (blake2b of
`<alias id>:<user>`, the first MINT_CANARY_USER_MAX_CHARS characters of it: a huge `user` costs no more to hash
than that); without a `user`, at random. Nothing secret is hashed, and the alias's id keys it: a `user` chosen
to land on the candidate lands there only for that tenant's own alias.

Counters: each request of a running canary adds to its arm's requests, errors and latency histogram in memory
(a dict update; no I/O on the request's path); a background flush, at most every MINT_CANARY_FLUSH_S, adds them
to the canary's Redis hash (shared by every gateway process: HINCRBY, one pipeline), reads back what the rule
needs and, when `breach` finds the candidate worse than the live revision, asks the control plane to abort it
(`canary_abort_auto` on a database thread: idempotent, so two processes asking costs one abort) and drops this
process's routes of the adapter at once (the abort's live event does the same in the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from redis.exceptions import RedisError

from serving.services import canary as rule
from serving.services import rollout

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from serving.gateway.background import Background, DatabaseThreads
    from serving.gateway.routes import Canary

log = logging.getLogger(__name__)

CANDIDATE, LIVE = rule.CANDIDATE, rule.LIVE
_SCALE = 10_000  # the hash's share is compared in hundredths of a percent
SWEPT_WINDOWS = 32  # latency windows gone by whose fields one flush deletes at most (a canary idle longer keeps some)


def user_share(alias_id: int, user: str) -> int:
    """Where a user falls in [0, 10 000) for this alias: the same for every request and every process."""
    bounded = user[: settings.MINT_CANARY_USER_MAX_CHARS]
    digest = hashlib.blake2b(f"{alias_id}:{bounded}".encode(errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SCALE


def to_candidate(canary: Canary, user: Any, *, rng: Callable[[], float] = random.random) -> bool:
    """Whether this request goes to the candidate: by its `user` (sticky) when it names one, else at random."""
    if isinstance(user, str) and user:
        return user_share(canary.alias_id, user) < canary.percent * (_SCALE // 100)
    return rng() * 100 < canary.percent


@dataclass(frozen=True)
class _Owner:
    alias_id: int
    started_us: int
    tenant_id: int
    adapter: str


class CanaryCounters:
    """This process's canary counts not yet in Redis, their flush, and the aborts it asked for."""

    def __init__(
        self,
        background: Background,
        client: Callable[[], aioredis.Redis],
        db: DatabaseThreads,
        on_abort: Callable[[int, str], None],
    ) -> None:
        self._background, self._client, self._db, self._on_abort = background, client, db, on_abort
        self._pending: dict[str, Counter[str]] = {}
        self._owners: dict[str, _Owner] = {}
        self._asked: set[str] = set()  # canaries this process asked to abort (once each)
        self._swept: dict[str, int] = {}  # per canary, the last latency window whose fields this process deleted
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flushing = False

    def record(self, canary: Canary, *, tenant_id: int, adapter: str, arm: str, error: bool, ms: float) -> None:
        """Count one request of `arm` (`CANDIDATE` or `LIVE`): an error (the node's 5xx, a timeout, no
        connection, no routable placement) or an answer, with its latency."""
        key = rule.counter_key(canary.alias_id, canary.started_us)
        counts = self._pending.get(key)
        if counts is None:
            counts = self._pending[key] = Counter()
            self._owners[key] = _Owner(canary.alias_id, canary.started_us, tenant_id, adapter)
        counts[f"{arm}:req"] += 1
        if error:
            counts[f"{arm}:err"] += 1
        else:
            bucket = rule.bucket_of(ms)
            counts[f"{arm}:b{bucket}"] += 1
            if settings.MINT_CANARY_LATENCY_MARGIN > 0:
                counts[f"{arm}:w{rule.window_of()}:{bucket}"] += 1
        loop = asyncio.get_running_loop()
        if self._timer is not None and self._loop is not loop:  # scheduled on a loop gone since (tests)
            self._timer, self._flushing = None, False
        if self._timer is None and not self._flushing:
            self._loop = loop
            self._timer = loop.call_later(settings.MINT_CANARY_FLUSH_S, self._due)

    def _due(self) -> None:
        self._timer = None
        self._flushing = True
        self._background.spawn(self.flush(), name="gateway canary flush")

    async def flush(self) -> list[str]:
        """Add the pending counts to Redis, check each canary's rule, ask for the aborts it calls for; the keys
        of the canaries whose abort was asked now."""
        try:
            pending, self._pending = self._pending, {}
            owners, self._owners = self._owners, {}
            if not pending:
                return []
            fields = rule.check_fields()
            ttl = settings.MINT_CANARY_COUNTER_TTL_S
            pipe = self._client().pipeline(transaction=False)
            sweeps: dict[str, bool] = {}
            for key, counts in pending.items():
                for field, n in counts.items():
                    pipe.hincrby(key, field, n)
                pipe.expire(key, ttl)
                pipe.hmget(key, fields)
                sweeps[key] = self._sweep(pipe, key)
            try:
                results = await pipe.execute()
            except RedisError as exc:
                log.warning("gateway: canary counters not written (%s); kept for the next flush", exc)
                for key, counts in pending.items():
                    self._pending.setdefault(key, Counter()).update(counts)
                    self._owners.setdefault(key, owners[key])
                return []
            asked = []
            index = 0
            for key, counts in pending.items():
                index += len(counts) + 1
                values = {f: int(v) for f, v in zip(fields, results[index], strict=True) if v is not None}
                index += 2 if sweeps[key] else 1
                reason = rule.breach(values)
                if reason is not None and key not in self._asked:
                    self._asked.add(key)
                    asked.append(key)
                    self._abort(key, owners[key], reason, values)
            return asked
        finally:
            self._flushing = False
            if self._pending and self._timer is None:
                with contextlib.suppress(RuntimeError):
                    self._loop = asyncio.get_running_loop()
                    self._timer = self._loop.call_later(settings.MINT_CANARY_FLUSH_S, self._due)

    def _sweep(self, pipe, key: str) -> bool:
        """With the latency rule on, delete the histogram fields of the windows the rule reads no more (once per
        window change, up to SWEPT_WINDOWS back): a canary's hash keeps a fixed number of fields, however long
        it runs. True if a deletion was queued on `pipe`."""
        if settings.MINT_CANARY_LATENCY_MARGIN <= 0:
            return False
        expired = rule.window_of() - settings.MINT_CANARY_LATENCY_WINDOWS
        since = max(self._swept.get(key, expired - SWEPT_WINDOWS), expired - SWEPT_WINDOWS)
        if expired <= since:
            return False
        pipe.hdel(key, *rule.window_fields(range(since + 1, expired + 1)))
        self._swept[key] = expired
        return True

    def _abort(self, key: str, owner: _Owner, reason: str, values: dict[str, int]) -> None:
        counts = {
            arm: {"requests": values.get(f"{short}:req", 0), "errors": values.get(f"{short}:err", 0)}
            for short, arm in ((CANDIDATE, "candidate"), (LIVE, "live"))
        }

        async def abort() -> None:
            try:
                done = await self._db.run(
                    lambda: rollout.canary_abort_auto(
                        alias_id=owner.alias_id, started_us=owner.started_us, reason=reason, counts=counts
                    )
                )
            except Exception:
                self._asked.discard(key)  # the next flush that finds the breach asks again
                raise
            if done:
                log.warning("gateway: aborted the canary of alias %s: %s", owner.alias_id, reason)
            self._on_abort(owner.tenant_id, owner.adapter)

        self._background.spawn(abort(), name=f"canary abort {owner.alias_id}")

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
