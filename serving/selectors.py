"""Reads of the serving plane, for its own services, the REST API, the gateway and the dashboard.

Aliases are serving state (what each name of an adapter serves now and should serve next), so
everything that shows or routes by an alias reads it here.
"""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, NodeState, Placement, PlacementState


def pinned_revisions(*, base_model_id: int | None = None, now=None) -> dict[int, int]:
    """Pinned revisions and their tenants: what aliases hold loaded (live and desired targets, and the
    previous live one until its rollback grace ends), of one base model or all."""
    now = now or timezone.now()
    aliases = Alias.objects.all()
    if base_model_id is not None:
        aliases = aliases.filter(adapter__base_model_id=base_model_id)
    pins: dict[int, int] = {}
    for live, desired, previous, until, tenant_id in aliases.values_list(
        "revision_id", "desired_revision_id", "previous_revision_id", "previous_pinned_until", "adapter__tenant_id"
    ):
        for revision_id in (live, desired, previous if until is not None and until >= now else None):
            if revision_id:
                pins[revision_id] = tenant_id
    return pins


def protected_revision_ids(*, now=None) -> set[int]:
    """Revisions that must stay loaded: live and desired alias targets, and the previous live one in its grace."""
    return set(pinned_revisions(now=now))


def with_aliases(adapters: QuerySet[Adapter], *, previous: bool = False, placements: bool = False) -> QuerySet[Adapter]:
    """`adapters` with their aliases (and the revisions they name) prefetched as `adapter.aliases.all()`, and
    with `placements`, where each desired revision is being placed."""
    related = ["revision", "desired_revision"] + (["previous_revision"] if previous else [])
    aliases = Alias.objects.select_related(*related).order_by("name")
    if placements:
        aliases = aliases.prefetch_related("desired_revision__placements__node")
    return adapters.prefetch_related(Prefetch("aliases", queryset=aliases))


def live_revision(*, adapter: Adapter, alias_name: str) -> AdapterRevision | None:
    """The revision an alias of `adapter` serves now, or None (no such alias, or it never flipped)."""
    alias = Alias.objects.filter(adapter=adapter, name=alias_name).select_related("revision").first()
    return alias.revision if alias is not None else None


def live_aliases(*, tenant_id: int) -> QuerySet[Alias]:
    """The tenant's aliases that serve a revision now, with their adapter (name, creation); in no given order."""
    return (
        Alias.objects.filter(adapter__tenant_id=tenant_id, revision__isnull=False)
        .select_related("adapter")
        .only("name", "adapter__name", "adapter__created_at")
    )


def ready_placements(*, revision: AdapterRevision) -> QuerySet[Placement]:
    """Where `revision` can be routed now: its ready placements on up nodes, with the node, oldest first."""
    return (
        Placement.objects.filter(revision=revision, state=PlacementState.READY, node__state=NodeState.UP)
        .select_related("node")
        .order_by("id")
    )


def alias_for_converge(alias_id: int) -> Alias | None:
    """An alias with what converging it reads (its adapter's base model, its desired revision)."""
    return Alias.objects.select_related("adapter__base_model", "desired_revision__adapter").filter(id=alias_id).first()
