"""Writes for adapters and revisions, one module per subject; callers use `adapters.services.<name>`.

- `registration`: creating adapters and setting their replicas, registering revisions (uploads, storage quotas,
  the fair queue).
- `transitions`: validation and export bookkeeping (called by tasks), delivery counts, approval, retry.
- `evaluation`: evaluation suites, the gate's policy, evaluation states (set by serving's runner), the verdict.
- `retirement`: archive and restore a revision, mark it keep, edit an adapter (description, tags, retention), mark
  it deleted (serving.services.retire checks aliases and nodes first).

Activation, rollback and aliases are serving state: serving.services.
"""

from adapters.services.evaluation import (
    Verdict,
    adapter_set_evaluation_policy,
    evaluation_finish,
    evaluation_note,
    evaluation_request,
    evaluation_start,
    evaluation_unavailable,
    evaluation_verdict,
    suite_upload,
    verdict_of,
)
from adapters.services.registration import (
    DuplicateRevision,
    IncompleteUpload,
    adapter_create,
    adapter_set_replicas,
    check_storage_quota,
    revision_fail_if_duplicate,
    revision_register,
    uploads_digest,
)
from adapters.services.retirement import (
    ARCHIVABLE_STATES,
    adapter_mark_deleted,
    adapter_set_retention,
    adapter_update,
    revision_archive,
    revision_restore,
    revision_set_keep,
)
from adapters.services.transitions import (
    RETRYABLE_FAILURE_CODES,
    revision_approve,
    revision_delivery_returned,
    revision_delivery_start,
    revision_ensure_export,
    revision_fail,
    revision_mark_exported,
    revision_mark_validated,
    revision_reject,
    revision_request_approval,
    revision_restore_export,
    revision_retries,
    revision_retry,
)

__all__ = [
    "ARCHIVABLE_STATES",
    "RETRYABLE_FAILURE_CODES",
    "DuplicateRevision",
    "IncompleteUpload",
    "Verdict",
    "adapter_create",
    "adapter_mark_deleted",
    "adapter_set_evaluation_policy",
    "adapter_set_replicas",
    "adapter_set_retention",
    "adapter_update",
    "check_storage_quota",
    "evaluation_finish",
    "evaluation_note",
    "evaluation_request",
    "evaluation_start",
    "evaluation_unavailable",
    "evaluation_verdict",
    "revision_approve",
    "revision_archive",
    "revision_delivery_returned",
    "revision_delivery_start",
    "revision_ensure_export",
    "revision_fail",
    "revision_fail_if_duplicate",
    "revision_mark_exported",
    "revision_mark_validated",
    "revision_register",
    "revision_reject",
    "revision_request_approval",
    "revision_restore",
    "revision_restore_export",
    "revision_retries",
    "revision_retry",
    "revision_set_keep",
    "suite_upload",
    "uploads_digest",
    "verdict_of",
]
