"""Reads of the adapter catalog. Every function takes the tenant (or an object already scoped to it)."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from adapters.models import Adapter, AdapterRevision, Alias, BaseModel, RevisionState
from mint_site.errors import MintError
from tenants.models import Tenant


def base_model_list() -> QuerySet[BaseModel]:
    return BaseModel.objects.all()


def base_model_by_name(name: str) -> BaseModel | None:
    return BaseModel.objects.filter(name=name).first()


def adapter_list(*, tenant: Tenant) -> QuerySet[Adapter]:
    aliases = Alias.objects.select_related("revision", "desired_revision").order_by("name")
    return (
        Adapter.objects.filter(tenant=tenant)
        .select_related("base_model")
        .prefetch_related(Prefetch("aliases", queryset=aliases))
    )


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


def revision_get(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .select_related("adapter__tenant", "adapter__base_model", "parent", "created_by", "created_by_key")
        .prefetch_related("approvals__decided_by", "approvals__decided_by_key")
        .first()
    )


def latest_revisions(*, adapter: Adapter, limit: int = 5) -> list[AdapterRevision]:
    return list(revision_list(adapter=adapter).order_by("-number")[:limit])
