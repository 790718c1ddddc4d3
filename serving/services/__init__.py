"""Writes of the serving plane, one module per subject; callers use `serving.services.<name>`.

- `aliases`: activation, its cancellation, rollback, convergence, replicas.
- `rollout`: the flip once a revision is ready; a canary of a candidate revision, promoted or aborted.
- `canary`: a canary's counters (written by the gateway) and the rule that aborts it.
- `placement`: placement requests, finding room, eviction; `admission`: admission, pacing, prewarm bookkeeping;
  `failover`: placing again what waits for a slot or lost its placements, and releasing what nothing names.
- `capacity`: the rules those follow: pinned-revision quotas, aliases per adapter, fair shares.
- `nodes`: registering nodes, recording their state, draining them, reconciling them with their engine.
- `sweep`: work whose task was lost, driven again.
- `retire`: deactivate an alias, archive a revision nothing names, delete an adapter; what leaves the nodes.
- `retention`: which revisions an adapter keeps, and archiving the rest (beat, after exports, when quota is full).
- `usage`: metered usage, added up per minute, hour and day; its retention.
- `budgets`: a month's tokens from the database (to rebuild a budget counter), budget events at 80 % and 100 %.

Dependencies inside run one way (pyproject.toml's import contracts hold it): nodes → sweep → aliases → rollout →
failover → placement → admission → (outbox, capacity, residency) → (models, selectors). Tasks are sent by name
(`outbox.send`): serving.tasks calls these services and is never imported by them.
"""

from serving.services.admission import (
    admit,
    admit_after_pause,
    placement_failed,
    placement_loaded,
    placement_warmed,
    prewarm_pacing_delay,
)
from serving.services.aliases import (
    activation_cancel,
    adapter_scale,
    alias_converge,
    alias_reserve,
    converge_aliases,
    placement_ready,
    revision_activate,
    revision_rollback,
)
from serving.services.budgets import usage_budget_crossed, usage_month_tokens
from serving.services.canary import canary_counts
from serving.services.failover import placement_forget, placements_retry
from serving.services.nodes import (
    drain_step,
    node_drain,
    node_reconcile,
    node_register,
    node_report_unreachable,
    node_set_state,
)
from serving.services.placement import eviction_victim, placement_request
from serving.services.residency import (
    node_copies_over_budget,
    node_copy_forget,
    node_copy_removed,
    node_copy_used,
    placements_touch,
    stray_loras,
)
from serving.services.retention import retention_preview
from serving.services.retire import adapter_delete, alias_deactivate, revision_archive
from serving.services.rollout import (
    alias_flip,
    canaries_stranded_abort,
    canary_abort,
    canary_abort_auto,
    canary_promote,
    canary_start,
)
from serving.services.usage import usage_add, usage_of_warmup, usage_purge

__all__ = [
    "activation_cancel",
    "adapter_delete",
    "adapter_scale",
    "admit",
    "admit_after_pause",
    "alias_converge",
    "alias_deactivate",
    "alias_flip",
    "alias_reserve",
    "canaries_stranded_abort",
    "canary_abort",
    "canary_abort_auto",
    "canary_counts",
    "canary_promote",
    "canary_start",
    "converge_aliases",
    "drain_step",
    "eviction_victim",
    "node_copies_over_budget",
    "node_copy_forget",
    "node_copy_removed",
    "node_copy_used",
    "node_drain",
    "node_reconcile",
    "node_register",
    "node_report_unreachable",
    "node_set_state",
    "placement_failed",
    "placement_forget",
    "placement_loaded",
    "placement_ready",
    "placement_request",
    "placement_warmed",
    "placements_retry",
    "placements_touch",
    "prewarm_pacing_delay",
    "retention_preview",
    "revision_activate",
    "revision_archive",
    "revision_rollback",
    "stray_loras",
    "usage_add",
    "usage_budget_crossed",
    "usage_month_tokens",
    "usage_of_warmup",
    "usage_purge",
]
