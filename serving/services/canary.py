"""A canary's counters and the rule that ends it: the gateway counts each arm, the rule reads the counts.

While a canary runs (serving/services/rollout.py), the gateway counts requests, errors and latency per arm in
Redis (`counter_key`), shared by every gateway process; after each flush it checks `breach` and, on a breach,
calls `canary_abort_auto`, which is idempotent (the canary it names, by its start, is aborted once; a later one
is never touched). Errors are what the candidate's nodes caused: 5xx answers, timeouts, connection failures, and
requests its share picked while none of its placements was routable; a caller's 4xx is counted as a request,
never as an error.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass

from django.conf import settings

from mint_site.errors import MintError
from mint_site.events import epoch_us
from serving.models import LATENCY_BOUNDS_MS, Alias

MAX_PERCENT = 50  # also the database's check (alias_canary_percent_valid)
CANDIDATE, LIVE = "c", "l"  # the arms, as counter fields name them
UNREACHABLE = "candidate unreachable"  # the reason a canary whose candidate nobody can reach ends with


def check_percent(percent: object) -> int:
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= MAX_PERCENT:
        raise MintError(
            f"canary_percent: must be a whole number from 1 to {MAX_PERCENT}.",
            code="invalid_canary_percent",
            detail={"canary_percent": [f"a whole number from 1 to {MAX_PERCENT}"]},
        )
    return percent


# ---------------------------------------------------------------- counters (written by the gateway) and the rule


def counter_key(alias_id: int, started_us: int) -> str:
    """The Redis hash of one canary's counters: a new canary on the same alias starts from zero."""
    return f"mint:canary:{alias_id}:{started_us}"


def bucket_of(ms: float) -> int:
    return bisect.bisect_left(LATENCY_BOUNDS_MS, ms)


def window_of(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // settings.MINT_CANARY_LATENCY_WINDOW_S)


_BUCKETS = len(LATENCY_BOUNDS_MS) + 1


def check_fields(now: float | None = None) -> list[str]:
    """The hash fields the rule reads: each arm's requests and errors, and with the latency rule on, each arm's
    latency histogram in the last MINT_CANARY_LATENCY_WINDOWS windows."""
    fields = [f"{arm}:{what}" for arm in (CANDIDATE, LIVE) for what in ("req", "err")]
    if settings.MINT_CANARY_LATENCY_MARGIN > 0:
        last = window_of(now)
        fields += window_fields(range(last - settings.MINT_CANARY_LATENCY_WINDOWS + 1, last + 1))
    return fields


def window_fields(windows: range) -> list[str]:
    """Both arms' latency-histogram fields of these windows (the gateway deletes those of windows gone by)."""
    return [f"{arm}:w{w}:{b}" for w in windows for arm in (CANDIDATE, LIVE) for b in range(_BUCKETS)]


def count_fields() -> list[str]:
    """The fields `canary_counts` shows: each arm's requests, errors and whole latency histogram."""
    return [
        f"{arm}:{what}" for arm in (CANDIDATE, LIVE) for what in ("req", "err", *(f"b{b}" for b in range(_BUCKETS)))
    ]


def _median_ms(histogram: list[int]) -> float | None:
    """The median of a latency histogram, as its bucket's upper bound (the last bucket: twice the last bound)."""
    total = sum(histogram)
    if not total:
        return None
    seen = 0
    for index, n in enumerate(histogram):
        seen += n
        if seen * 2 >= total:
            return float(LATENCY_BOUNDS_MS[index] if index < len(LATENCY_BOUNDS_MS) else 2 * LATENCY_BOUNDS_MS[-1])
    return None


@dataclass(frozen=True)
class Arm:
    requests: int
    errors: int
    p50_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p50_ms": self.p50_ms,
        }


def _int(values: dict[str, int], field: str) -> int:
    return int(values.get(field) or 0)


def breach(values: dict[str, int], now: float | None = None) -> str | None:
    """Why the canary must be aborted, from its counters (`check_fields`), or None.

    Errors: the candidate has at least MINT_CANARY_MIN_REQUESTS requests and its error rate exceeds the live
    revision's by more than MINT_CANARY_ERROR_MARGIN. Latency (when MINT_CANARY_LATENCY_MARGIN > 0): over the last
    MINT_CANARY_LATENCY_WINDOWS windows of MINT_CANARY_LATENCY_WINDOW_S in which both arms had requests (at
    least MINT_CANARY_LATENCY_WINDOWS of them), the median of the candidate's median latency over the live
    one's exceeds 1 + the margin: one slow window (a noisy neighbour, a cold cache) does not abort.
    """
    candidate = Arm(_int(values, "c:req"), _int(values, "c:err"))
    live = Arm(_int(values, "l:req"), _int(values, "l:err"))
    minimum = settings.MINT_CANARY_MIN_REQUESTS
    margin = settings.MINT_CANARY_ERROR_MARGIN
    if candidate.requests >= minimum and candidate.error_rate - live.error_rate > margin:
        return (
            f"error rate {candidate.error_rate:.1%} ({candidate.errors} of {candidate.requests} requests) exceeds "
            f"the live revision's {live.error_rate:.1%} ({live.errors} of {live.requests}) by more than "
            f"MINT_CANARY_ERROR_MARGIN {margin:.1%}"
        )
    latency_margin = settings.MINT_CANARY_LATENCY_MARGIN
    if latency_margin <= 0:
        return None
    last = window_of(now)
    ratios = []
    for w in range(last - settings.MINT_CANARY_LATENCY_WINDOWS + 1, last + 1):
        medians = [_median_ms([_int(values, f"{arm}:w{w}:{b}") for b in range(_BUCKETS)]) for arm in "cl"]
        if medians[0] is not None and medians[1]:
            ratios.append(medians[0] / medians[1])
    if len(ratios) >= settings.MINT_CANARY_LATENCY_WINDOWS and statistics.median(ratios) > 1 + latency_margin:
        return (
            f"median latency over the last {len(ratios)} windows is {statistics.median(ratios):.2f} times the live "
            f"revision's, above 1 + MINT_CANARY_LATENCY_MARGIN {latency_margin:.2f}"
        )
    return None


def _redis():
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)


def canary_counts(*, alias: Alias) -> dict | None:
    """The running canary's counters per arm (requests, errors, error rate, p50 latency), or None without a
    canary; `{"unavailable": true}` when Redis cannot be read."""
    if alias.canary_revision_id is None or alias.canary_started_at is None:
        return None
    key = counter_key(alias.id, epoch_us(alias.canary_started_at))
    import redis

    fields = count_fields()
    try:
        raw = _redis().hmget(key, fields)  # a fixed number of fields, however long the canary has run
    except redis.RedisError:
        return {"unavailable": True}
    values = {field: int(v) for field, v in zip(fields, raw, strict=True) if v is not None}
    arms = {}
    for arm, name in ((CANDIDATE, "candidate"), (LIVE, "live")):
        histogram = [_int(values, f"{arm}:b{b}") for b in range(_BUCKETS)]
        arms[name] = Arm(_int(values, f"{arm}:req"), _int(values, f"{arm}:err"), _median_ms(histogram)).as_dict()
    return arms
