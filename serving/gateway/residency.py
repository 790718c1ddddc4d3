"""The gateway's side of residency (serving/residency/): requests for revisions that are loaded on demand.

- A live revision resident nowhere answers 503 `adapter_not_ready` at once, after asking the control plane for a
  load at request priority (`ColdStarts.ask`, once per revision however many requests come: they share the ask).
  The ask returns when the revision should be ready (the node's queue and its measured load times:
  serving/selectors/residency.py), and `Retry-After` says it in whole seconds, rounded up, at least 1; later
  requests count down from it. The official `openai` client honours it (two retries by default).
- A request with `X-Mint-Wait: <seconds>` is held instead, up to that long within its tenant's plan
  (`max_cold_wait_s`), at most `max_held_requests` of a tenant at once in this process (429 past it), awaiting the
  revision's ready event (the live-events feed) or re-reading its route every HOLD_POLL_S: a held request is a
  suspended coroutine, no thread. When the wait runs out it gets the 503 it would have had. A client's n-th
  retry that finds the load due within n² times MINT_RESIDENCY_RETRY_HOLD_S is held that long without asking (its
  503 at once while the tenant has `max_held_requests` held): it came back when told to.
- Every request routed to a revision counts towards the revision's frequency (hits and misses alike), in memory,
  added to Redis at most every MINT_RESIDENCY_FLUSH_S from a database thread: the admission filter of every node
  reads them (serving/services/residency.py).
- `GpuTiers` models each node's GPU batch (vLLM's LRU over `--max-loras`) from the requests this process sends,
  so routing prefers a node where the adapter is likely in the batch already, and the tiers' hits are counted.
- A revision served from one node with MINT_RESIDENCY_SPREAD_INFLIGHT requests in flight on every replica asks for
  another placement (at request priority, within its tenant's share); an unused replica is evicted when cold.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from cachetools import TTLCache
from django.conf import settings

from adapters import selectors as adapter_selectors
from serving.gateway import GatewayError
from serving.gateway.metrics import COLD_HELD, RESIDENCY_REQUESTS
from serving.models import Priority
from serving.selectors import residency as readiness
from serving.selectors.pins import pinned_revisions
from serving.services import residency as admission
from serving.services.placement import placement_request

if TYPE_CHECKING:
    from serving.gateway.background import Background, DatabaseThreads
    from serving.gateway.caches import RefreshingCache
    from serving.gateway.routes import Resolution, Target

log = logging.getLogger(__name__)

WAIT_HEADER = "x-mint-wait"
RETRY_HEADER = "x-stainless-retry-count"
HOLD_POLL_S = 0.5  # a held request re-reads its route this often when no ready event woke it
ASK_TIMEOUT_S = 1.0  # the first request of a cold revision waits this long for the control plane's answer
_ASKED = 10_000  # revisions whose readiness estimate a process remembers (bounded like the other caches)


def retry_after(seconds: float) -> int:
    """`Retry-After` for an expected wait: whole seconds, rounded up, 1 at least."""
    return max(1, math.ceil(seconds - 1e-9))


_RETRIES_COUNTED = 100  # past this, a count means nothing more (the holds it earns are bounded by the plan)


def retries(headers) -> int:
    """How many times the client says it sent this request before (`X-Stainless-Retry-Count`, as the official
    `openai` clients send after a 503 and its `Retry-After`; 0 when absent, 1 when not a number).

    A retry is the same request, not counted again towards its revision's frequency: counted per attempt, every
    cold request retried once would read as asked for twice, and no entry loaded on demand would ever count as
    one-off (serving/residency/policy.py)."""
    raw = (headers.get(RETRY_HEADER) or "").strip()
    if raw in ("", "0"):
        return 0
    try:
        return max(1, min(int(raw), _RETRIES_COUNTED))
    except ValueError:
        return 1


def wait_asked(headers, plan) -> float:
    """How long the request asks to be held for a load (`X-Mint-Wait`), bounded by its plan; 0: not held.
    A value that is not a number is a 400 naming the header."""
    raw = headers.get(WAIT_HEADER)
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise GatewayError(400, "invalid_header", f"{WAIT_HEADER}: a number of seconds, not {raw[:40]!r}.") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise GatewayError(400, "invalid_header", f"{WAIT_HEADER}: a number of seconds, 0 or more.")
    return min(seconds, float(plan.max_cold_wait_s))


def cold_load_sync(revision_id: int) -> float:
    """Ask for the revision to be loaded at request priority (serving/services/residency.py decides where and
    what leaves); the seconds until it should be ready (serving/selectors/residency.py)."""
    revision = adapter_selectors.revision_with_adapter(revision_id=revision_id)
    if revision is None:
        return 0.0
    placement_request(revision=revision, priority=Priority.COLD_REQUEST)
    return readiness.expected_ready_s(revision_id)


def spread_sync(revision_id: int, replicas: int) -> None:
    """One more placement of an on-demand revision busy on every replica it has (at request priority, within its
    tenant's share, at most the plan's `max_replicas`): `ColdStarts.maybe_spread` asks. A pinned revision's
    replicas are its alias's setting: a replica spread from it would be pinned too, and never given back."""
    try:
        revision = adapter_selectors.revision_with_adapter(revision_id=revision_id)
        if revision is None or revision.id in pinned_revisions(base_model_id=revision.adapter.base_model_id):
            return
        replicas = min(replicas, revision.adapter.tenant.max_replicas)
        placement_request(revision=revision, priority=Priority.COLD_REQUEST, replicas=replicas)
    except Exception:
        log.exception("spreading revision %s failed", revision_id)


class ColdStarts:
    """This process's asks for loads, held requests, request counts and spreads (see the module docstring)."""

    def __init__(self, background: Background, db: DatabaseThreads, asked: RefreshingCache) -> None:
        self._background, self._db = background, db
        # (tenant id, revision id) → the monotonic time it is due: shared out per tenant, so that one tenant asking
        # for many revisions cannot make another's be asked again.
        self._expected = asked
        self._asking: dict[int, asyncio.Future] = {}
        self._events: dict[int, asyncio.Event] = {}
        self.held: Counter[int] = Counter()  # held requests per tenant
        self._holders: Counter[int] = Counter()  # held requests per revision
        self._counts: Counter[int] = Counter()
        self._tiers: Counter[tuple[str, str]] = Counter()
        self._spread: TTLCache = TTLCache(maxsize=_ASKED, ttl=30)
        self._flush_due = time.monotonic()
        self._flushing = False

    # ------------------------------------------------------------------ the 503's Retry-After

    async def ask(self, revision_id: int, tenant_id: int, tally=None) -> float:
        """Ask for a load of the revision (once per revision while an estimate stands) and return the seconds until
        it should be ready. The request that starts the ask is its cold start (`tally.cold_start`)."""
        now = time.monotonic()
        key = (tenant_id, revision_id)
        hit, due = self._expected.get(key)
        if hit and due > now:
            return due - now
        asking = self._asking.get(revision_id)
        if asking is None:
            asking = self._asking[revision_id] = asyncio.ensure_future(self._db.run(cold_load_sync, revision_id))
            asking.add_done_callback(lambda _f, k=key: self._asked(k, _f))
            if tally is not None:
                tally.cold_start = True
        try:
            seconds = await asyncio.wait_for(asyncio.shield(asking), ASK_TIMEOUT_S)
        except (TimeoutError, Exception):  # the ask goes on; meanwhile a first guess
            seconds = float(settings.MINT_RESIDENCY_MIN_RESIDENT_S)
        return max(0.0, float(seconds))

    def _asked(self, key: tuple[int, int], future: asyncio.Future) -> None:
        self._asking.pop(key[1], None)
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("gateway: the load of revision %s was not asked: %s", key[1], future.exception())
            return
        seconds = max(0.0, float(future.result()))
        # Asked again once it is due (a load that failed, an eviction meanwhile) or after the cache's TTL.
        self._expected.put(key, time.monotonic() + seconds)

    # ------------------------------------------------------------------ held requests

    def ready(self, revision_id: int | None = None) -> None:
        """A revision became ready (a live event): wake its held requests (all of them, without an id)."""
        events = self._events.values() if revision_id is None else [self._events.get(revision_id)]
        for event in list(events):
            if event is not None:
                event.set()

    async def hold(
        self, tenant_id: int, revision_id: int, *, seconds: float, plan, load, asked: bool = True
    ) -> Resolution | None:
        """Hold a request until `load()` (its route, read again) finds the revision ready, for up to `seconds`.
        None when the wait ran out; past the tenant's held requests, 429 for a request that `asked` to be held
        (X-Mint-Wait), None at once for another."""
        if self.held[tenant_id] >= plan.max_held_requests:
            if not asked:
                return None
            raise GatewayError(
                429,
                "too_many_held_requests",
                f"This tenant has {plan.max_held_requests} requests held for loads already (plan field "
                "max_held_requests); retry after Retry-After, or without X-Mint-Wait.",
                headers={"Retry-After": "1"},
            )
        self.held[tenant_id] += 1
        self._holders[revision_id] += 1
        event = self._events.setdefault(revision_id, asyncio.Event())
        deadline = time.monotonic() + seconds
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    async with asyncio.timeout(min(HOLD_POLL_S, left)):
                        await event.wait()
                except TimeoutError:
                    pass
                event.clear()
                found = await load()
                if found is not None and found.targets:
                    COLD_HELD.labels("ready").inc()
                    return found
            COLD_HELD.labels("timeout").inc()
            return None
        finally:
            for counter, key in ((self.held, tenant_id), (self._holders, revision_id)):
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]
            if revision_id not in self._holders:
                self._events.pop(revision_id, None)

    # ------------------------------------------------------------------ frequencies, spreading

    def count(self, revision_id: int) -> None:
        """One request for the revision (a hit or a miss): it feeds every node's admission filter."""
        self._counts[revision_id] += 1
        self._maybe_flush()

    def tier(self, node: str, tier: str) -> None:
        """One request routed to `node` finding its adapter in `tier` (`gpu`, `cpu`; `miss` under stats.FLEET)."""
        self._tiers[(node, tier)] += 1

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if not self._flushing and now >= self._flush_due:
            self._flushing = True
            self._flush_due = now + settings.MINT_RESIDENCY_FLUSH_S
            self._background.spawn(self._db.run(self._flush), name="gateway residency flush")

    def _flush(self) -> None:
        counts, self._counts = self._counts, Counter()
        tiers, self._tiers = self._tiers, Counter()
        try:
            admission.record_requests(dict(counts), dict(tiers))
        except Exception as exc:  # Redis away: the policy decides by recency meanwhile
            log.warning("gateway: request counts not added (%s)", exc)
        finally:
            self._flushing = False

    def maybe_spread(self, resolution: Resolution, inflight: Counter[int]) -> bool:
        """Ask for one more placement of a revision busy on every replica it has (once per 30 s at most)."""
        targets = resolution.targets
        if not targets or resolution.revision_id in self._spread:
            return False
        if min(inflight[t.placement_id] for t in targets) < settings.MINT_RESIDENCY_SPREAD_INFLIGHT:
            return False
        self._spread[resolution.revision_id] = True
        self._background.spawn(
            self._db.run(spread_sync, resolution.revision_id, len(targets) + 1),
            name=f"spread r{resolution.revision_id}",
        )
        return True


class GpuTiers:
    """Each node's GPU batch as this process's requests would fill it: vLLM keeps `--max-loras` adapters active and
    swaps in the least recently used way. An estimate (vLLM does not say which adapters it holds there), good
    enough to route a request to the node likelier to have its adapter active, and to count the tiers' hits."""

    def __init__(self) -> None:
        self._nodes: dict[str, OrderedDict[str, None]] = {}

    def holds(self, target: Target) -> bool:
        """Whether a request for `target` finds its adapter active there, or a free slot for it: swapping it into a
        batch with room evicts no other adapter, so idle replicas share requests rather than one taking them all."""
        lru = self._nodes.get(target.node_name)
        return lru is None or target.lora_name in lru or len(lru) < max(1, target.gpu_slots)

    def use(self, target: Target) -> str:
        """Record a request sent to `target`; the tier it found its adapter in (`gpu` or `cpu`). Counted in
        /metrics here; the caller adds it to the per-minute stats (`ColdStarts.tier`)."""
        lru = self._nodes.setdefault(target.node_name, OrderedDict())
        tier = "gpu" if target.lora_name in lru else "cpu"
        lru[target.lora_name] = None
        lru.move_to_end(target.lora_name)
        while len(lru) > max(1, target.gpu_slots):
            lru.popitem(last=False)
        RESIDENCY_REQUESTS.labels(target.node_name, tier).inc()
        return tier
