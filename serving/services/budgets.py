"""Monthly token budgets: the month's tokens as the database has them (to rebuild a counter Redis lost), and the
live event that tells a tenant's dashboard a budget reached 80 % or 100 %.

The counters themselves live in Redis and are kept by the gateway (serving/gateway/budgets.py), which calls these
from its database threads, never on a request's path; their key layout is here, where the evaluation runner
(serving/services/evaluation.py) finds it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.core.cache import cache
from django.db.models import F, Sum
from django.utils import timezone

from mint_site.events import live_event
from serving.models import BILLED_KINDS, UsagePeriod, UsageRecord

BUDGET_EVENT = "usage.budget"
# The cache key (Django's cache, Redis) that makes each budget event go once: <prefix>:<who>:<month>:<budget>:<%>.
BUDGET_EVENT_KEY = "usage.budget"
# Thresholds of a budget that send an event, in per cent.
BUDGET_THRESHOLDS = (80, 100)

# The token counters in Redis (kept by serving/gateway/budgets.py, added to by the evaluation runner): under
# KEY_PREFIX, `…:tpm:<who>:<minute>` (one minute's tokens) and `…:month:<who>:<YYYY-MM>`, where `<who>` is
# `t<tenant id>` or `k<key id>`.
KEY_PREFIX = "mint:gw:tokens"
WINDOW_S = 60


def who(tenant_id: int, key_id: int | None) -> str:
    return f"k{key_id}" if key_id is not None else f"t{tenant_id}"


def window_key(tenant_id: int, key_id: int | None, minute: int) -> str:
    return f"{KEY_PREFIX}:tpm:{who(tenant_id, key_id)}:{minute}"


def month_key(tenant_id: int, key_id: int | None, month: str) -> str:
    return f"{KEY_PREFIX}:month:{who(tenant_id, key_id)}:{month}"


@dataclass(frozen=True, slots=True)
class Period:
    """The minute window and the calendar month (UTC) an instant falls in."""

    minute: int  # the window's index: seconds since the epoch // 60
    month: str  # YYYY-MM
    month_start: datetime
    month_end: datetime  # the next month's first instant

    @classmethod
    def at(cls, now: float) -> Period:
        moment = datetime.fromtimestamp(now, tz=UTC)
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return cls(minute=int(now // WINDOW_S), month=start.strftime("%Y-%m"), month_start=start, month_end=end)

    @property
    def minute_end(self) -> float:
        return (self.minute + 1) * WINDOW_S


def usage_month_tokens(*, tenant_id: int, key_id: int | None = None, start: datetime, end: datetime) -> int:
    """Tokens (prompt and completion) of the tenant's gateway traffic, or one key's, from `start` to `end`.

    Read from the day rows of metered usage (the billed kinds, inference and sampling: MinT's own warm-ups and
    evaluations are never billed), so `start`
    and `end` are UTC midnights (a calendar month's bounds). What the gateways metered but have not flushed yet
    is not in it. A read beside its writes: serving/gateway/budgets.py calls it to rebuild a month's counter.
    """
    rows = UsageRecord.objects.filter(
        tenant_id=tenant_id, period=UsagePeriod.DAY, kind__in=BILLED_KINDS, start__gte=start, start__lt=end
    )
    if key_id is not None:
        rows = rows.filter(key_id=key_id)
    total = rows.aggregate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))["tokens"]
    return int(total or 0)


def usage_budget_crossed(
    *,
    tenant_id: int,
    key_id: int | None,
    key_prefix: str = "",
    month: str,
    threshold: int,
    used: int,
    budget: int,
    resets_at: datetime,
) -> bool:
    """Tell the tenant's dashboard (and staff) that a monthly token budget reached `threshold` per cent.

    Sent once per tenant (or key), month, budget and threshold across every gateway process: the first caller
    sets a key in Redis (`SET NX`, kept until a day after the reset) and only it sends. A budget changed within
    the month gets events of its own. Redis lost meanwhile: the event may be sent once more. Returns whether
    this call sent it.
    """
    who = f"k{key_id}" if key_id is not None else f"t{tenant_id}"
    timeout = max(60, int((resets_at - timezone.now()).total_seconds()) + 86400)
    if not cache.add(f"{BUDGET_EVENT_KEY}:{who}:{month}:{budget}:{threshold}", 1, timeout=timeout):
        return False
    live_event(
        tenant_id=tenant_id,
        type=BUDGET_EVENT,
        id=key_id if key_id is not None else tenant_id,
        state="exhausted" if threshold >= 100 else "warning",
        scope="key" if key_id is not None else "tenant",
        key=key_prefix or None,
        threshold=threshold,
        used=used,
        budget=budget,
        month=month,
        resets_at=resets_at.isoformat(),
    )
    return True
