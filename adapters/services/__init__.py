"""Writes for adapters and revisions, one module per subject; callers use `adapters.services.<name>`.

- `registration`: creating adapters, registering revisions (uploads, storage quotas, the fair queue).
- `transitions`: validation and export bookkeeping (called by tasks), delivery counts, approval.

Activation, rollback and aliases are serving state: serving.services.
"""

from adapters.services.registration import adapter_create, check_storage_quota, revision_register
from adapters.services.transitions import (
    export_is_complete,
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
)

__all__ = [
    "adapter_create",
    "check_storage_quota",
    "export_is_complete",
    "revision_approve",
    "revision_delivery_returned",
    "revision_delivery_start",
    "revision_ensure_export",
    "revision_fail",
    "revision_mark_exported",
    "revision_mark_validated",
    "revision_register",
    "revision_reject",
    "revision_request_approval",
    "revision_restore_export",
]
