"""Tokens per minute and monthly token budgets, per tenant and per key: reserved at admission, settled at the end,
shared in Redis.

The gateway has no tokenizer: a request's tokens are known only once its node has answered (vLLM's `usage`, a
stream's last chunk; serving/gateway/metering.py fills the request's `Tally`). So a request arriving while its
tenant's (or key's) counter has reached the limit is refused: 429 `tokens_per_minute_exceeded` (a fixed
one-minute window, `Retry-After` to its end) or 429 `budget_exhausted` (a calendar month, UTC; `Retry-After` to
the first instant of the next month, which the message names with the budget). A request admitted adds what it
may cost at most to every limited counter at once (`admit`: `max_tokens` times `n` plus an estimate of its prompt,
serving/gateway/policy/fields.py), and gives it back when it ends, when what it used is counted (`spend`). So
requests arriving together see each other's reservations: past a limit by at most one request's reservation
(the last one admitted), whatever the concurrency, within one process; across processes, as of each one's last
sync (below). Reservations stay in the process that made them: Redis totals (and the budget events read from
them) are only ever what was used.

A request never waits on Redis (the pattern of ratelimit.py and inflight.py). Each process keeps, per counter,
the total as Redis last reported it (`known`) and its own tokens not yet sent there (`pending`), and decides on
their sum. A background task sends the pending tokens of every counter in one Lua script call and reads back the
totals, which include every other process's tokens: as soon as tokens are counted (while one call runs, what
comes in waits for the next), and again for a counter a request checked once what it knows is FRESH_S old. So
within one process a limit holds on every answered request; across processes, as of each one's last sync (a
Redis round trip behind while it counts the tenant's tokens, FRESH_S while it only checks them); a process that
has not read a counter yet (just started, or a tenant idle there for IDLE_S) admits what arrives before its
first read.

Redis keys, under KEY_PREFIX (`<who>` is `t<tenant id>` or `k<key id>`):

- `…:tpm:<who>:<minute>`: the tokens of one minute window, created by its first tokens, kept two minutes.
  Counted only for a tenant or key with a limit (a limit set mid-window counts from then).
- `…:month:<who>:<YYYY-MM>`: the tokens of a month, kept until a day after it. Never created by an increment:
  a process that needs an absent one (the tenant or key has a budget; a new month; Redis flushed or restarted
  empty) rebuilds it from PostgreSQL off the request path: the month's day rows of metered usage
  (`serving.services.budgets.usage_month_tokens`) on a database thread, then `SET NX`, so one seed wins and every
  process adds its pending tokens to it. A tenant's month counter is added to whenever it exists, budget or
  not, so a budget set again later in the month starts from the right count; while it is absent and the tenant
  has no budget, its tokens are not sent (it is looked for again every FRESH_S).

A rebuilt counter is as exact as the database: the tokens metered but not flushed yet (up to
MINT_GATEWAY_USAGE_FLUSH_S of a process's traffic) are missing from it or, for the process that seeds it, may
be counted twice.

Events: when a month counter with a budget reaches 80 % and 100 % of it, `serving.services.budgets.usage_budget_crossed`
is called on a database thread (once per counter, budget and threshold in this process); the service sends the
live event once per month, budget and threshold across processes.

When Redis is unreachable each process limits on what it knew plus its own tokens, and logs the failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from mint_site.redis_breaker import REDIS_DOWN, RedisBreaker
from serving.gateway import GatewayError
from serving.gateway.metrics import TOKENS_REFUSED
from serving.gateway.token_counts import SYNC_SCRIPT, Count, Reservation
from serving.services.budgets import (  # the counters' Redis layout, shared with the evaluation runner
    BUDGET_THRESHOLDS,
    KEY_PREFIX,  # noqa: F401  (the counters' prefix, for those who read them: tests, benchmarks)
    WINDOW_S,
    Period,
    month_key,
    usage_budget_crossed,
    usage_month_tokens,
    window_key,
)

if TYPE_CHECKING:
    from serving.gateway.auth import Caller
    from serving.gateway.background import Background, DatabaseThreads

log = logging.getLogger(__name__)

FRESH_S = 1.0  # how old a counter's total may be before a request that checks it asks for it again
IDLE_S = 600.0  # a counter nobody checked or spent on for this long is forgotten (read again when next needed)
_SEED_RETRY_S = 5.0  # after a rebuild that failed (the database or Redis), before the next try


class TokenLimits:
    """The process's token counters per tenant and key, their sync to Redis, and the checks requests pass."""

    def __init__(
        self,
        background: Background,
        client: Callable[[], aioredis.Redis],
        db: DatabaseThreads,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._background, self._client, self._db = background, client, db
        self.clock = clock  # wall-clock seconds: windows and months follow it (tests move it)
        self._windows: dict[tuple[int, int | None, int], Count] = {}  # (tenant id, key id, minute) → count
        self._months: dict[tuple[int, int | None, str], Count] = {}  # (tenant id, key id, month) → count
        self._dirty: set[Count] = set()  # counts to sync: tokens to send, or a total to read
        self._period: Period | None = None
        self._task: asyncio.Task | None = None
        self._script: AsyncScript | None = None
        self._breaker = RedisBreaker("gateway token limits", meanwhile="local counts")

    # -----------------------------------------------------------------------------------------
    # On the request path: in memory only

    def check(self, caller: Caller) -> None:
        """Raise a 429 `GatewayError` if the caller's tenant or key has used up its tokens this minute or month."""
        plan = caller.plan
        key_tpm, key_budget = caller.max_tokens_per_minute, caller.monthly_token_budget
        if not (plan.monthly_token_budget or plan.max_tokens_per_minute or key_tpm or key_budget):
            return
        now = self.clock()
        period = self._period_at(now)
        try:
            if plan.monthly_token_budget:
                self._check_month(self._month(period, caller, None, plan.monthly_token_budget), caller, now)
            if key_budget:
                self._check_month(self._month(period, caller, caller.key_id, key_budget), caller, now)
            if plan.max_tokens_per_minute:
                self._check_window(self._window(period, caller, None), plan.max_tokens_per_minute, caller, now)
            if key_tpm:
                self._check_window(self._window(period, caller, caller.key_id), key_tpm, caller, now)
        finally:
            if self._dirty:
                self._keep_synced()  # the totals checked that were getting old are read again

    def admit(self, caller: Caller, tokens: int) -> Reservation | None:
        """`check` the caller's limits, then reserve `tokens` (what the request may cost at most) on each limited
        counter at once: the next request, however soon, counts it. Given back by `spend` when the request ends.

        No await between the check and the reservation: requests arriving together are admitted one by one.
        A reservation is this process's alone (never sent to Redis, whose totals and the budget events on them
        stay what was used): other processes see the tokens once they are spent.
        """
        self.check(caller)
        if tokens <= 0:
            return None
        counts = self._limited(caller, self._period_at(self.clock()))
        if not counts:
            return None
        for count in counts:
            count.reserved += tokens
        return Reservation(tokens, tuple(counts))

    def spend(self, caller: Caller, tokens: int, reservation: Reservation | None = None) -> None:
        """Count an answered request's tokens against its tenant's and key's counters (sent in the background),
        and give back the `reservation` it was admitted with."""
        if reservation is not None:
            for count in reservation.counts:
                count.reserved -= reservation.tokens
        if tokens <= 0:
            return
        period = self._period_at(self.clock())
        counts = self._limited(caller, period)
        if not caller.plan.monthly_token_budget:  # the tenant's month is counted budget or not (module docstring)
            counts.insert(0, self._month(period, caller, None, 0))
        now = time.monotonic()
        dirty = False
        for count in counts:
            if count.absent and not count.budget and now - count.read_at < FRESH_S:
                continue  # Redis had no such counter lately, and no budget needs one: nothing to keep up to date
            count.pending += tokens
            self._dirty.add(count)
            dirty = True
        if dirty:
            self._keep_synced()

    def _limited(self, caller: Caller, period: Period) -> list[Count]:
        """The counters that limit the caller now: its tenant's and key's months with a budget, minutes with a rate."""
        plan, counts = caller.plan, []
        if plan.monthly_token_budget:
            counts.append(self._month(period, caller, None, plan.monthly_token_budget))
        if caller.monthly_token_budget:
            counts.append(self._month(period, caller, caller.key_id, caller.monthly_token_budget))
        if plan.max_tokens_per_minute:
            counts.append(self._window(period, caller, None))
        if caller.max_tokens_per_minute:
            counts.append(self._window(period, caller, caller.key_id))
        return counts

    def _check_month(self, count: Count, caller: Caller, now: float) -> None:
        self._keep_fresh(count)
        if count.total < count.budget:
            return
        TOKENS_REFUSED.labels(caller.tenant_slug, "budget_exhausted").inc()
        resets = count.period.month_end
        raise GatewayError(
            429,
            "budget_exhausted",
            f"{_holder(caller, count)} has used its monthly budget of {count.budget:,} tokens "
            f"({count.used:,} in {count.period.month}, UTC); it resets at {resets:%Y-%m-%dT%H:%M:%SZ}.",
            headers={"Retry-After": str(max(1, math.ceil(resets.timestamp() - now)))},
        )

    def _check_window(self, count: Count, limit: int, caller: Caller, now: float) -> None:
        self._keep_fresh(count)
        if count.total < limit:
            return
        TOKENS_REFUSED.labels(caller.tenant_slug, "tokens_per_minute_exceeded").inc()
        raise GatewayError(
            429,
            "tokens_per_minute_exceeded",
            f"{_holder(caller, count)} has used its limit of {limit:,} tokens per minute; retry when the minute ends.",
            headers={"Retry-After": str(max(1, math.ceil(count.period.minute_end - now)))},
        )

    def _keep_fresh(self, count: Count) -> None:
        """A request looked at this count: have its total read again if what this process knows is getting old."""
        if count.used_at - count.read_at >= FRESH_S and not count.seeding:
            self._dirty.add(count)

    def _period_at(self, now: float) -> Period:
        period = self._period
        if period is None or int(now // WINDOW_S) != period.minute:
            period = self._period = Period.at(now)
            self._forget_stale(period)
        return period

    def _month(self, period: Period, caller: Caller, key_id: int | None, budget: int | None) -> Count:
        index = (caller.tenant_id, key_id, period.month)
        count = self._months.get(index)
        if count is None:
            count = self._months[index] = Count(
                month_key(caller.tenant_id, key_id, period.month),
                caller.tenant_id,
                key_id,
                period,
                month=True,
                key_prefix=caller.key_prefix if key_id is not None else "",
            )
        count.budget = budget or 0  # the plan as the latest request's key carried it
        count.used_at = time.monotonic()
        return count

    def _window(self, period: Period, caller: Caller, key_id: int | None) -> Count:
        index = (caller.tenant_id, key_id, period.minute)
        count = self._windows.get(index)
        if count is None:
            count = self._windows[index] = Count(
                window_key(caller.tenant_id, key_id, period.minute), caller.tenant_id, key_id, period, month=False
            )
        count.used_at = time.monotonic()
        return count

    def _forget_stale(self, period: Period) -> None:
        """At each new minute: drop windows before the last one, other months' counts once sent, idle counts."""
        idle = time.monotonic() - IDLE_S
        self._windows = {k: c for k, c in self._windows.items() if k[2] >= period.minute - 1 and c.used_at > idle}
        self._months = {
            k: c
            for k, c in self._months.items()
            if c.pending or c.seeding or (k[2] == period.month and c.used_at > idle)
        }
        self._dirty = {c for c in self._dirty if c.month or c.period.minute >= period.minute - 1}

    # -----------------------------------------------------------------------------------------
    # In the background: the sync with Redis, rebuilds from the database, budget events

    def _keep_synced(self) -> None:
        if self._breaker.open:
            return  # Redis failed lately: what is dirty waits for the first request after the pause
        task = self._task
        # A task left pending on a loop that is gone (tests run one loop per call) is replaced too.
        if task is None or task.done() or task.get_loop().is_closed():
            self._task = self._background.spawn(self._keep(), name="token counts sync")

    def _due(self) -> list[Count]:
        """The counts to sync now; a tenant's month Redis lately had not, and that needs none, is let go."""
        now = time.monotonic()
        batch = []
        for count in self._dirty:
            if count.seeding:
                continue  # synced once its rebuild is done
            if count.absent and not count.budget and now - count.read_at < FRESH_S:
                count.pending = 0  # nothing to add to: the database has these tokens, and no budget needs them
                continue
            batch.append(count)
        self._dirty.clear()
        return batch

    async def _keep(self) -> None:
        while batch := self._due():
            if self._breaker.open:
                self._dirty.update(batch)  # kept for when Redis answers again; limits hold on local counts
                return
            await self._sync(batch)

    async def _sync(self, batch: list[Count]) -> None:
        now = self.clock()
        sent = [count.pending for count in batch]
        args: list[int] = []
        for count, tokens in zip(batch, sent, strict=True):
            args += [tokens, 0 if count.month else 1, count.ttl(now)]
        client = self._client()
        if self._script is None:
            self._script = client.register_script(SYNC_SCRIPT)
        try:
            totals = await self._script(keys=[c.redis_key for c in batch], args=args, client=client)
        except REDIS_DOWN as exc:
            self._breaker.trip(exc)
            self._dirty.update(batch)
            return
        except BaseException:
            self._dirty.update(batch)
            raise
        read_at = time.monotonic()
        for count, tokens, total in zip(batch, sent, totals, strict=True):
            total = int(total)
            count.read_at = read_at
            if total < 0:  # a month Redis has no counter for
                count.absent = True
                if count.budget:
                    self._rebuild(count)  # its pending tokens wait for the seed
                else:
                    count.pending -= tokens
                continue
            count.absent = False
            count.pending -= tokens
            count.known = total
            if count.month and count.budget:
                self._announce_crossings(count)

    def _rebuild(self, count: Count) -> None:
        if count.seeding or time.monotonic() < count.seed_after:
            return
        count.seeding = True
        self._background.spawn(self._seed(count), name=f"rebuild {count.redis_key}")

    async def _seed(self, count: Count) -> None:
        """Rebuild an absent month counter from the database (on a database thread), unless another process has."""
        try:
            start, end = count.period.month_start, count.period.month_end
            used = await self._db.run(
                lambda: usage_month_tokens(tenant_id=count.tenant_id, key_id=count.key_id, start=start, end=end)
            )
            await self._client().set(count.redis_key, used, nx=True, ex=count.ttl(self.clock()))
        except Exception as exc:
            count.seed_after = time.monotonic() + _SEED_RETRY_S
            log.warning("gateway token limits: rebuilding %s failed (%s); retried later", count.redis_key, exc)
        else:
            log.info("gateway token limits: rebuilt %s from the database (%d tokens)", count.redis_key, used)
        finally:
            count.seeding = False
        self._dirty.add(count)  # send its pending tokens and read the total, whoever's seed won
        self._keep_synced()

    def _announce_crossings(self, count: Count) -> None:
        for threshold in BUDGET_THRESHOLDS:
            mark = (count.budget, threshold)
            if mark in count.crossed or count.known * 100 < threshold * count.budget:
                continue
            count.crossed.add(mark)
            self._background.spawn(
                self._announce(count, threshold, count.known), name=f"budget {threshold}% {count.redis_key}"
            )

    async def _announce(self, count: Count, threshold: int, used: int) -> None:
        budget = count.budget
        try:
            await self._db.run(_budget_crossed, count, threshold, used, budget)
        except Exception:
            count.crossed.discard((budget, threshold))  # asked again at the next sync that sees it
            log.warning("gateway token limits: budget event for %s not sent", count.redis_key, exc_info=True)

    def known(self, tenant_id: int, key_id: int | None = None, *, month: bool = True) -> int | None:
        """What this process counts for a tenant's (or key's) current month or minute, None if nothing (tests)."""
        period = self._period_at(self.clock())
        index = (tenant_id, key_id)
        count = self._months.get((*index, period.month)) if month else self._windows.get((*index, period.minute))
        return None if count is None else count.used


def _holder(caller: Caller, count: Count) -> str:
    if count.key_id is not None:
        return f"Key mint_{caller.key_prefix}_…"
    return f"Tenant {caller.tenant_slug}"


def _budget_crossed(count: Count, threshold: int, used: int, budget: int) -> bool:
    return usage_budget_crossed(
        tenant_id=count.tenant_id,
        key_id=count.key_id,
        key_prefix=count.key_prefix,
        month=count.period.month,
        threshold=threshold,
        used=used,
        budget=budget,
        resets_at=count.period.month_end,
    )
