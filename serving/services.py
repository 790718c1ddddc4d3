"""Writes of the serving plane: placement, admission, prewarm bookkeeping, eviction, alias convergence."""

from __future__ import annotations

from adapters.models import AdapterRevision
from serving.models import Placement


def placement_request(*, revision: AdapterRevision, priority: int) -> Placement | None:
    """Ask for `revision` to be loaded on a node of its base model (queued for admission).

    Returns the placement (existing or new; an existing one keeps the higher priority), or
    None when no node of that base model is up. Never waits for the load itself.
    """
    raise NotImplementedError
