"""Reads of the adapter catalog. Every function takes the tenant (or an object already scoped to it)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import Coalesce

from adapters.models import Adapter, AdapterRevision, BaseModel, RevisionState
from mint_site.errors import MintError
from tenants.models import Tenant


@dataclass(frozen=True)
class StorageUse:
    """What a tenant keeps in the artifact store: bytes of uploads and exports, and revisions holding them."""

    bytes: int
    revisions: int


def storage_use(*, tenant: Tenant) -> StorageUse:
    """As the tenant row counts it (kept current by the services that store and collect files)."""
    return StorageUse(bytes=tenant.stored_bytes, revisions=tenant.stored_revisions)


def storage_recount(*, tenant: Tenant) -> StorageUse:
    """Counted from the revisions whose files are kept (not yet collected): what the row's counters must equal."""
    totals = AdapterRevision.objects.filter(adapter__tenant=tenant, purged_at__isnull=True).aggregate(
        bytes=Coalesce(Sum("size_bytes"), 0) + Coalesce(Sum("export_bytes"), 0), revisions=Count("id")
    )
    return StorageUse(bytes=int(totals["bytes"]), revisions=totals["revisions"])


def base_model_list() -> QuerySet[BaseModel]:
    return BaseModel.objects.all()


def base_model_by_name(name: str) -> BaseModel | None:
    return BaseModel.objects.filter(name=name).first()


def adapter_list(*, tenant: Tenant) -> QuerySet[Adapter]:
    return Adapter.objects.filter(tenant=tenant).select_related("base_model")


def revision_list(*, adapter: Adapter, state: str | None = None) -> QuerySet[AdapterRevision]:
    revisions = AdapterRevision.objects.filter(adapter=adapter).select_related("parent", "created_by", "created_by_key")
    if state:
        states = [s.strip() for s in state.split(",") if s.strip()]
        unknown = [s for s in states if s not in RevisionState.values]
        if unknown:
            raise MintError(
                f"state: unknown state(s) {', '.join(unknown)}; use {', '.join(RevisionState.values)}.",
                detail={"state": unknown},
            )
        revisions = revisions.filter(state__in=states)
    return revisions


def adapter_named(*, tenant_id: int, name: str) -> Adapter | None:
    """A tenant's adapter by name, only what routing needs (id, name, tenant); None if it has none."""
    return Adapter.objects.filter(tenant_id=tenant_id, name=name).only("id", "name", "tenant_id").first()


def approved_revision(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    """`adapter`'s r<number> if it is approved (what a pinned `<adapter>@r<n>` may call), else None."""
    return AdapterRevision.objects.filter(adapter=adapter, number=number, state=RevisionState.APPROVED).first()


def revision_with_adapter(*, revision_id: int) -> AdapterRevision | None:
    return AdapterRevision.objects.select_related("adapter").filter(id=revision_id).first()


def revision_get(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .select_related("adapter__tenant", "adapter__base_model", "parent", "created_by", "created_by_key")
        .prefetch_related("approvals__decided_by", "approvals__decided_by_key")
        .first()
    )


def latest_revisions(*, adapter: Adapter, limit: int = 5) -> list[AdapterRevision]:
    return list(revision_list(adapter=adapter).order_by("-number")[:limit])
