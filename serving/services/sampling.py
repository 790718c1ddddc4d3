"""Sampling's part in placement: a revision registered with `prewarm` (an RL step about to be sampled) is placed on
a node as soon as its export is published, so its first sample finds it loaded instead of waiting for a cold load.

It asks as a cold request does (serving/gateway/sampling.py): on-demand capacity only, a free slot or one nobody
pins, never another tenant's reserved revisions (serving.services.placement.placement_request at COLD_REQUEST priority).
"""

from __future__ import annotations

import logging

from adapters import selectors as adapter_selectors
from serving.models import Priority
from serving.services.placement import placement_request

log = logging.getLogger(__name__)


def on_revision_exported(*, revision_id: int, **_) -> None:
    """adapters.signals.revision_exported (after commit): place a `prewarm` revision now."""
    revision = adapter_selectors.revision_with_adapter(revision_id=revision_id)
    if revision is None or not revision.prewarm:
        return
    placement = placement_request(revision=revision, priority=Priority.COLD_REQUEST)
    log.info("prewarm of %s on export: %s", revision, placement.state if placement is not None else "no room")
