"""Metering: what every request through the gateway used (tokens, latency, status), for billing and charts.

A request fills its `Tally` as it is handled (the caller's tenant and key, the revision its model resolved to,
the node that answered, the tokens vLLM's `usage` reported; for a stream, the usage vLLM sends last, and until
then the running usage it sends on every chunk: the gateway asks for both whatever the client asked, and keeps
from the client what it did not ask for, so a stream that ends before its last chunk, because the client left
or a limit or the node ended it, is billed what it streamed). When the answer has been sent, `Meter.record`
adds it to a per-minute count in memory: a dict update under a lock, nothing else on the request's path.
A background flush, at most every MINT_GATEWAY_USAGE_FLUSH_S, adds the counts to their minute, hour and day rows
in PostgreSQL (`serving.services.usage_add`, one transaction of additive upserts) from a database thread.

Counted once: a flush takes the counts out of memory first and puts them back if its transaction fails, so a
count is either in a committed row or still pending. A clean shutdown flushes what is pending (the application's
lifespan, serving/gateway/state.py); a crash loses at most one flush interval of counts.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings

from serving import services as serving_services
from serving.gateway.metrics import TOKENS
from serving.models import LATENCY_BOUNDS_MS, USAGE_COUNTS, UsageKind

if TYPE_CHECKING:
    from serving.gateway.background import Background, DatabaseThreads

log = logging.getLogger(__name__)

_WIDTH = len(USAGE_COUNTS)
_FIRST_BUCKET = USAGE_COUNTS.index("lat_0")
_COLD_STARTS = USAGE_COUNTS.index("cold_starts")


@dataclass(slots=True)
class Tally:
    """What one request used, filled in while it is handled. 0 and "" stand for not known (yet)."""

    tenant_id: int = 0
    key_id: int = 0
    adapter_id: int = 0
    adapter_name: str = ""
    revision: int = 0
    node: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # A stream's running usage (vLLM's continuous_usage_stats): choice index → (prompt, completion) tokens so far.
    running: dict[int, tuple[int, int]] = field(default_factory=dict)
    final: bool = False  # the totals were seen (an answer's `usage`, a stream's last chunk): running counts no more
    broken: bool = False  # the node broke off a stream under way (a canary counts it as the node's error)
    cold_start: bool = False  # it asked for a load on demand of a revision loaded nowhere (residency.py)

    def add_usage(self, usage: Any) -> None:
        """Take vLLM's totals: a completion's `usage`, or a stream's last chunk (no choices)."""
        prompt, completion = _tokens(usage)
        if prompt is not None:
            self.prompt_tokens = prompt
        if completion is not None:
            self.completion_tokens = completion
        self.final = self.final or prompt is not None or completion is not None

    def add_running_usage(self, usage: Any, *, index: Any, choices_per_prompt: int = 1) -> None:
        """Take one stream chunk's running usage: its prompt's tokens and its choice's so far. Until the totals
        come, the tally is the sum over choices (each prompt's tokens once: choice `index` answers prompt
        `index // choices_per_prompt`, as vLLM numbers them), so a stream that ends before its last chunk is
        billed what it streamed."""
        prompt, completion = _tokens(usage)
        if self.final or not isinstance(index, int) or prompt is None or completion is None:
            return
        self.running[index] = (prompt, completion)
        prompts: dict[int, int] = {}
        for i, (p, _) in self.running.items():
            prompts[i // max(1, choices_per_prompt)] = p
        self.prompt_tokens = sum(prompts.values())
        self.completion_tokens = sum(c for _, c in self.running.values())


def _tokens(usage: Any) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) and prompt >= 0 else None,
        completion if isinstance(completion, int) and completion >= 0 else None,
    )


def flush_interval() -> float:
    return float(settings.MINT_GATEWAY_USAGE_FLUSH_S)


class Meter:
    """Per-minute counts of one gateway process, recorded on the event loop and flushed from a database thread."""

    def __init__(self, background: Background, db: DatabaseThreads, *, clock=time.time) -> None:
        self._background, self._db, self._clock = background, db, clock
        self._lock = threading.Lock()
        self._counts: dict[tuple, list[float]] = {}
        self._minutes: dict[int, datetime] = {}
        self._last_flush = time.monotonic()
        self._flushing = False
        self._timer: asyncio.TimerHandle | None = None  # a flush due later, for counts no later request flushes
        self._loop: asyncio.AbstractEventLoop | None = None

    def _minute(self, now: float) -> datetime:
        index = int(now // 60)
        found = self._minutes.get(index)
        if found is None:
            self._minutes = {index: datetime.fromtimestamp(index * 60, tz=UTC)}  # one entry: minutes only advance
            found = self._minutes[index]
        return found

    def record(
        self,
        tally: Tally,
        *,
        status: int,
        seconds: float,
        kind: str = UsageKind.INFERENCE,
        labels: tuple[str, str] | None = None,
    ) -> None:
        """Count one answered request of a known tenant (in memory; `maybe_flush` writes it later).

        `labels` (tenant slug, adapter name) also count its tokens in Prometheus."""
        if not tally.tenant_id:
            return
        ms = seconds * 1000
        key = (
            self._minute(self._clock()),
            kind,
            tally.tenant_id,
            tally.key_id,
            tally.adapter_id,
            tally.adapter_name,
            tally.revision,
            tally.node,
            status,
        )
        bucket = _FIRST_BUCKET + bisect.bisect_left(LATENCY_BOUNDS_MS, ms)
        with self._lock:
            counts = self._counts.get(key)
            if counts is None:
                counts = self._counts[key] = [0] * _WIDTH
            counts[0] += 1
            counts[1] += tally.prompt_tokens
            counts[2] += tally.completion_tokens
            counts[3] += ms
            counts[bucket] += 1
            counts[_COLD_STARTS] += tally.cold_start
        if labels is not None and (tally.prompt_tokens or tally.completion_tokens):
            TOKENS.labels(labels[0], labels[1], "prompt").inc(tally.prompt_tokens)
            TOKENS.labels(labels[0], labels[1], "completion").inc(tally.completion_tokens)

    def pending(self) -> int:
        with self._lock:
            return len(self._counts)

    def maybe_flush(self) -> None:
        """Schedule a flush on the running loop if the interval has passed and none is running; with counts
        pending and the interval not over, make sure one comes when it is, even if no request follows."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            if self._flushing or not self._counts:
                return
            wait = flush_interval() - (time.monotonic() - self._last_flush)
            if wait > 0:
                if self._timer is None:
                    self._timer = self._loop.call_later(wait, self._timer_fired)
                return
            self._flushing = True
            self._last_flush = time.monotonic()
        self._background.spawn(self._db.run(self._flush_in_thread), name="gateway metering flush")

    def _timer_fired(self) -> None:
        self._timer = None
        self.maybe_flush()

    def cancel_timer(self) -> None:
        """At shutdown: the last flush is the lifespan's (GatewayState.shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _flush_in_thread(self) -> None:
        try:
            self.flush()
        except Exception:  # noqa: S110  (flush() logged it and kept the counts)
            pass
        finally:
            with self._lock:
                self._flushing = False
                again = bool(self._counts)
            if again and self._loop is not None:
                # Counted while this flush ran: their flush is due one interval from now, requests or not.
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown flushes them)
                    self._loop.call_soon_threadsafe(self.maybe_flush)

    def flush(self) -> int:
        """Add every pending count to the database now (in a thread that may use the ORM); rows written."""
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return 0
        try:
            return serving_services.usage_add(counts=counts)
        except Exception:
            log.exception("gateway metering flush failed; keeping %d counts for the next one", len(counts))
            with self._lock:
                for key, values in counts.items():
                    pending = self._counts.get(key)
                    if pending is None:
                        self._counts[key] = values
                    else:
                        pending[:] = [a + b for a, b in zip(pending, values, strict=True)]
            raise
