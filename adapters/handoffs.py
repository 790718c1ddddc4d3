"""When work handed to a worker through the broker counts as lost: one rule for the control queue
(adapters/dispatch.py) and for serving's node queues (serving/services/sweep.py).

A row that hands work over records when its task was sent (one field or more: `dispatched_at`, `started_at`,
`updated_at`) and when a worker began it (`picked_up_at`). A hand-off no worker has begun since it was sent is
unbegun: nothing runs it, so it may safely be sent again once it is known to be lost. It is known lost once a
probe sent MINT_TASK_PICKUP_S after it reached a worker (the queue is first in, first out: that worker has taken
everything sent before), or once it is overdue: sent before a bound and not back by then, begun or not.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Q


def pickup() -> timedelta:
    """How long a hand-off may wait in the broker unbegun before a probe checks whether it was lost."""
    return timedelta(seconds=settings.MINT_TASK_PICKUP_S)


def _sent_before(sent: tuple[str, ...], before: datetime) -> Q:
    return Q(**{f"{field}__lt": before for field in sent})


def unbegun(*sent: str, before: datetime | None = None) -> Q:
    """Hand-offs no worker has begun since they were sent: never picked up, or picked up before one of the `sent`
    times (by an earlier task of the row). With `before`: only those sent (every one of `sent`) before then."""
    condition = Q(picked_up_at__isnull=True)
    for field in sent:
        condition |= Q(picked_up_at__lt=F(field))
    return condition if before is None else _sent_before(sent, before) & condition


def overdue(*sent: str, before: datetime) -> Q:
    """Hand-offs sent before `before` and not back: not begun since they were sent, or begun before `before`."""
    return _sent_before(sent, before) & (unbegun(*sent) | Q(picked_up_at__lt=before))
