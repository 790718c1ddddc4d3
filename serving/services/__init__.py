"""Writes of the serving plane, one module per subject: `serving.services.<module>.<service>`. The package itself
names the services the dashboard and the dev tools call.

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

from serving.services.aliases import activation_cancel, revision_activate, revision_rollback
from serving.services.nodes import node_drain, node_register, node_set_state, node_undrain
from serving.services.retention import retention_preview
from serving.services.retire import adapter_delete, alias_deactivate, revision_archive
from serving.services.rollout import alias_flip, canary_abort, canary_promote
from serving.services.usage import usage_add

__all__ = [
    "activation_cancel",
    "adapter_delete",
    "alias_deactivate",
    "alias_flip",
    "canary_abort",
    "canary_promote",
    "node_drain",
    "node_register",
    "node_set_state",
    "node_undrain",
    "retention_preview",
    "revision_activate",
    "revision_archive",
    "revision_rollback",
    "usage_add",
]
