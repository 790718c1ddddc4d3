"""Writes for adapters and revisions, one module per subject: `adapters.services.<module>.<service>`. The package
itself names the services the dashboard and the REST API call.

- `registration`: creating adapters and setting their replicas, registering revisions (uploads, storage quotas,
  the fair queue).
- `transitions`: validation and export bookkeeping (called by tasks), delivery counts, approval, retry.
- `evaluation`: evaluation suites, the gate's policy, evaluation states (set by serving's runner), the verdict.
- `retirement`: archive and restore a revision, mark it keep, edit an adapter (description, tags, retention), mark
  it deleted (serving.services.retire checks aliases and nodes first).

Activation, rollback and aliases are serving state: serving.services.
"""

from adapters.services.evaluation import adapter_set_evaluation_policy, suite_upload, verdict_of
from adapters.services.registration import DuplicateRevision, adapter_create, revision_register
from adapters.services.retirement import (
    ARCHIVABLE_STATES,
    adapter_set_retention,
    adapter_update,
    revision_restore,
    revision_set_keep,
)
from adapters.services.transitions import (
    RETRYABLE_FAILURE_CODES,
    revision_approve,
    revision_fail,
    revision_reject,
    revision_request_approval,
    revision_retry,
)

__all__ = [
    "ARCHIVABLE_STATES",
    "RETRYABLE_FAILURE_CODES",
    "DuplicateRevision",
    "adapter_create",
    "adapter_set_evaluation_policy",
    "adapter_set_retention",
    "adapter_update",
    "revision_approve",
    "revision_fail",
    "revision_register",
    "revision_reject",
    "revision_request_approval",
    "revision_restore",
    "revision_retry",
    "revision_set_keep",
    "suite_upload",
    "verdict_of",
]
