"""Per-tenant cap on gateway requests in flight, counted here and shared through Redis under leases.

A tenant may have at most its plan's `max_inflight_requests` requests and streams in flight at once, across
every gateway process: from after authentication until its answer is sent (a stream until it ends or its
client goes away). Past that, 429 `too_many_requests_in_flight` with `Retry-After: 1`.

A request never waits on Redis. Each process counts its own requests in flight exactly, in memory, and
decides on its own count plus the other processes' counts as it last read them. A background task syncs
with Redis: one Lua script call, for every tenant this process holds slots of at once, writes this
process's counts under a lease (`<count> <expiry>` in a hash per tenant, a field per process, the expiry
on Redis's clock) and reads back the sum of the other processes' unexpired counts, deleting expired ones.
It syncs SYNC_EVERY_S after this process's counts change (changes in between coalesce: a request shorter
than that mostly never reaches Redis), at least every FRESH_S while the process holds slots (which also
renews its leases), and SYNC_EVERY_S after a refusal that depended on the others' counts. Leases last
MINT_GATEWAY_INFLIGHT_LEASE_S, so the slots of a process that died stop counting within one lease.

The bound across P processes: the cap holds exactly within a process, and across processes as of each
one's last read of the others, which is at most SYNC_EVERY_S old (plus a Redis round trip) while its
counts of the tenant change, at most FRESH_S old while they stay put, up to 2 * FRESH_S for a tenant it
holds nothing of but read after a refusal, and absent for a tenant it has not seen lately. So a tenant is
over its cap only by requests that other processes admitted since that read: a burst that reaches P
processes at once, none of which has seen the others' slots, may be admitted up to P times the cap, for
at most one such interval, after which every process refuses the tenant until it is back under. The
other way, a process may refuse a tenant for one SYNC_EVERY_S after slots were freed elsewhere. When
Redis is unreachable each process enforces the cap on its own count alone (and forgets what it knew of
the others).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from django.conf import settings
from redis.commands.core import AsyncScript
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mint_site.redis_breaker import REDIS_DOWN, RedisBreaker

if TYPE_CHECKING:
    from serving.gateway.background import Background

KEY_PREFIX = "mint:gw:inflight"
SYNC_EVERY_S = 0.02  # how soon a change of this process's counts reaches Redis (changes in between coalesce)
FRESH_S = 0.25  # how often the others' counts are read again while this process holds slots

# KEYS: one hash per tenant. ARGV[1]: this process; ARGV[2]: the lease in ms; ARGV[2 + i]: this process's
# count for KEYS[i]. Writes the counts (0 removes the field), drops expired fields, and returns for each key
# the sum of the other processes' live counts. The clock is Redis's, so the processes' clocks do not matter.
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, lease = ARGV[1], tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local mine = tonumber(ARGV[i + 2])
  if mine > 0 then
    redis.call('HSET', key, me, mine .. ' ' .. (now + lease))
  else
    redis.call('HDEL', key, me)
  end
  local others = 0
  local fields = redis.call('HGETALL', key)
  for j = 1, #fields, 2 do
    if fields[j] ~= me then
      local count, expiry = string.match(fields[j + 1], '^(%d+) (%d+)$')
      if count and tonumber(expiry) > now then
        others = others + tonumber(count)
      else
        redis.call('HDEL', key, fields[j])
      end
    end
  end
  if (mine > 0 or others > 0) and redis.call('PTTL', key) < lease then
    redis.call('PEXPIRE', key, lease)
  end
  out[i] = others
end
return out
"""


def key_for(tenant_id: int) -> str:
    return f"{KEY_PREFIX}:{tenant_id}"


def lease_s() -> float:
    return float(settings.MINT_GATEWAY_INFLIGHT_LEASE_S)


class InflightCap:
    """This process's requests in flight per tenant, what it knows of the others', and its sync to Redis."""

    def __init__(self, background: Background, client: Callable[[], aioredis.Redis]) -> None:
        self._background = background
        self._client = client
        # Names this process's field in every tenant's hash; unique even for two states in one process.
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._live: dict[int, int] = {}  # tenant id → this process's requests in flight
        self._published: dict[int, int] = {}  # tenant id → this process's count as Redis holds it
        # tenant id → (the other processes' count, until when it is trusted): read at each sync that covers the
        # tenant (every FRESH_S while this process holds its slots), and trusted for twice that.
        self._others: dict[int, tuple[int, float]] = {}
        self._reads: set[int] = set()  # tenants refused on the others' counts: read them again
        self._fresh_at = 0.0  # when the others' counts (and this process's leases) are next read (and renewed)
        self._breaker = RedisBreaker("gateway in-flight cap", meanwhile="local counts")
        self._task: asyncio.Task | None = None
        self._script: AsyncScript | None = None

    def live(self, tenant_id: int) -> int:
        """This process's requests of the tenant in flight now."""
        return self._live.get(tenant_id, 0)

    def others(self, tenant_id: int) -> int:
        """The other processes' requests of the tenant in flight, as of the last sync (0 once that is stale)."""
        known = self._others.get(tenant_id)
        return known[0] if known is not None and known[1] > time.monotonic() else 0

    def take(self, tenant_id: int, limit: int) -> Callable[[], None] | None:
        """A slot for one request of the tenant: its release (idempotent), or None when the tenant is at `limit`."""
        live = self._live.get(tenant_id, 0)
        known = self._others.get(tenant_id)
        others = known[0] if known is not None and known[1] > time.monotonic() else 0
        if live + others >= limit:
            if others:
                self._reads.add(tenant_id)
                self._keep_synced()
            return None
        self._live[tenant_id] = live + 1
        self._keep_synced()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._live.get(tenant_id, 0) - 1
            if left > 0:
                self._live[tenant_id] = left
            else:
                self._live.pop(tenant_id, None)
            self._keep_synced()

        return release

    def _keep_synced(self) -> None:
        task = self._task
        # A task left pending on a loop that is gone (tests run one loop per call) is replaced too.
        if task is None or task.done() or task.get_loop().is_closed():
            self._task = self._background.spawn(self._keep(), name="in-flight sync")

    def _due(self) -> list[int]:
        """The tenants to sync now (every tenant held or published, so leases and the others' counts stay
        fresh together), or none when nothing changed, nobody asked for a read and nothing held is stale."""
        held = self._live.keys() | self._published.keys()
        changed = any(self._live.get(t, 0) != self._published.get(t, 0) for t in held)
        if changed or self._reads or (self._live and time.monotonic() >= self._fresh_at):
            return sorted(held | self._reads)
        return []

    async def _keep(self) -> None:
        """Sync every SYNC_EVERY_S while anything is held or owed to Redis; ends when nothing is."""
        while True:
            await asyncio.sleep(SYNC_EVERY_S)
            if self._breaker.open:
                if not self._live:
                    return
                continue
            tenants = self._due()
            if tenants:
                await self._sync(tenants)
            elif not self._live:
                return

    async def _sync(self, tenants: list[int], *, leaving: bool = False) -> None:
        counts = [0 if leaving else self._live.get(t, 0) for t in tenants]
        reads, self._reads = self._reads, set()
        lease = lease_s()
        client = self._client()
        if self._script is None:
            self._script = client.register_script(_SYNC)
        try:
            others = await self._script(
                keys=[key_for(t) for t in tenants],
                args=[self.process, max(1, int(lease * 1000)), *counts],
                client=client,
            )
        except REDIS_DOWN as exc:
            # Redis's copy of our counts is unknown now (its leases run out on their own): decide on this
            # process's counts alone, and write them all again once Redis answers.
            self._breaker.trip(exc)
            self._published.clear()
            self._others.clear()
            return
        except BaseException:
            self._reads |= reads
            raise
        for tenant_id, count in zip(tenants, counts, strict=True):
            if count:
                self._published[tenant_id] = count
            else:
                self._published.pop(tenant_id, None)
        now = time.monotonic()
        valid_until = now + 2 * FRESH_S
        for tenant_id, count in zip(tenants, others, strict=True):
            if int(count):
                self._others[tenant_id] = (int(count), valid_until)
            else:
                self._others.pop(tenant_id, None)
        if len(self._others) > len(tenants):
            self._others = {t: known for t, known in self._others.items() if known[1] > now}
        if self._live.keys() <= set(tenants):
            self._fresh_at = now + min(FRESH_S, lease / 3)

    async def aclose(self) -> None:
        """At shutdown: stop syncing, and take this process's counts out of Redis (best effort) so that the
        other processes stop counting them now rather than when their leases run out."""
        task, self._task = self._task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._published and not self._breaker.open:
            await self._sync(sorted(self._published), leaving=True)


class Held(Response):
    """`response`, and `done()` once it has been sent or could not be (the client left, a send failed, the task
    was cancelled): what a request holds while in flight is let go only when its answer is over."""

    def __init__(self, response: Response, done: Callable[[], None]) -> None:
        # Not Response.__init__: nothing is rendered here, the wrapped response is sent as it is.
        self.response = response
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background = None
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self._done()
