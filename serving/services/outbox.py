"""What the serving writes hand on: tasks to the workers and node agents, and placement moves to their tenant.

Tasks are sent by name. `serving.tasks` loads rows by id and calls these services, so the services never import
it back (the import graph runs models ← selectors ← services ← tasks); tests/serving/test_task_names.py checks
that every name sent is a task there.
"""

from __future__ import annotations

from datetime import datetime

from celery import signature

from adapters.models import AdapterRevision
from mint_site.events import epoch_us, live_event
from serving.models import ServingNode


def send(
    task: str,
    *,
    queue: str | None = None,
    countdown: float | None = None,
    expires: float | None = None,
    **kwargs: object,
) -> None:
    """Enqueue the task `serving.tasks.<task>` with these keyword arguments (a node's queue for node work).
    Callers inside a transaction send it from `transaction.on_commit`."""
    signature(f"serving.tasks.{task}", kwargs=kwargs).apply_async(queue=queue, countdown=countdown, expires=expires)


def placement_event(
    placement_id: int,
    *,
    state: str,
    updated_at: datetime,
    revision: AdapterRevision,
    node: ServingNode,
    **fields: float | str | None,
) -> None:
    """Tell the revision's tenant (and staff) that a placement moved. `revision.adapter` must be loaded.

    `updated_us` is the `updated_at` the move wrote: events from different processes, and a page
    rendered meanwhile, can reach a browser out of order, and it drops what is older than it shows.
    """
    live_event(
        tenant_id=revision.adapter.tenant_id,
        type="placement.state",
        id=placement_id,
        state=state,
        updated_us=epoch_us(updated_at),
        adapter=revision.adapter.name,
        revision=f"r{revision.number}",
        node=node.name,
        **{name: value for name, value in fields.items() if value is not None},
    )
