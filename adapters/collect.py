"""Garbage collection of the files of failed and rejected revisions.

A failed or rejected revision will never serve, but its upload (and a rejected one's
export) would hold the tenant's storage quota, and the platform's disk, forever. Once
it has been over for MINT_UPLOAD_RETENTION_DAYS (longer than any retry window, so a
Retry still finds its files), its files are removed and `purged_at` is set: the row,
its failure reason and its audit trail stay. Sources registered by `source_uri` live in
the tenant's own incoming area and are left to the tenant. Beat runs this hourly.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from adapters import store
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)

BATCH = 500


def owned_prefixes(revision: AdapterRevision, *, source: bool = True) -> list[str]:
    """Store prefixes that belong to this revision alone: its exports and (with `source`) its upload (never a
    tenant's incoming files)."""
    adapter_prefix = store.adapter_prefix(revision.adapter)
    prefixes = [f"{adapter_prefix}/r{revision.number}"]  # export/ and any .export-* staging
    if source and revision.source_uri.startswith(f"{adapter_prefix}/uploads/"):
        prefixes.append(revision.source_uri)
    return prefixes


def uploads_collect(*, now=None, batch: int = BATCH) -> int:
    """Remove the files of revisions failed or rejected more than the retention ago; returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.MINT_UPLOAD_RETENTION_DAYS)
    due = list(
        AdapterRevision.objects.filter(state__in=[S.FAILED, S.REJECTED], purged_at__isnull=True, updated_at__lte=cutoff)
        .select_related("adapter__tenant")
        .order_by("updated_at")[:batch]
    )
    for revision in due:
        store.delete_prefixes(owned_prefixes(revision))
        with transaction.atomic():
            if not AdapterRevision.objects.filter(id=revision.id, purged_at__isnull=True).update(purged_at=now):
                continue  # another collector got there first
            Tenant.objects.filter(id=revision.adapter.tenant_id).update(
                stored_bytes=Greatest(F("stored_bytes") - (revision.size_bytes + revision.export_bytes), 0),
                stored_revisions=Greatest(F("stored_revisions") - 1, 0),
            )
            audit_record(
                tenant=revision.adapter.tenant,
                actor=Actor.system(),
                action="revision.purge",
                target=f"revision:{revision.adapter.name}@r{revision.number}",
                before={"state": revision.state, "size_bytes": revision.size_bytes + revision.export_bytes},
                after={"files": "removed"},
            )
    if due:
        log.info("collected the files of %d failed or rejected revisions", len(due))
    return len(due)
