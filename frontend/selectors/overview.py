"""The overview: a page of the tenant's adapters, each with its production alias and how ready it is."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce

from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision, RevisionState
from frontend.selectors import PAGE_SIZE
from serving import selectors as serving_selectors
from serving.models import Alias, Placement, PlacementState
from tenants.models import Tenant

# The overview explains at most this many pending activations (a few queries each); the others link to their page.
OVERVIEW_EXPLAINED = 10
IN_FLIGHT = (PlacementState.QUEUED, PlacementState.LOADING, PlacementState.WARMING)


@dataclass
class Readiness:
    """How a revision stands on the serving nodes: ready on some, or on its way, or nowhere."""

    ready: int = 0
    in_flight: list[str] = field(default_factory=list)  # states of placements not ready yet
    failed: int = 0

    @property
    def label(self) -> str:
        if self.ready:
            return "ready"
        if self.in_flight:
            order = [PlacementState.WARMING, PlacementState.LOADING, PlacementState.QUEUED]
            return next(s for s in order if s in self.in_flight)
        if self.failed:
            return "failed"
        return "cold"


def _readiness(revision_ids: list[int]) -> dict[int, Readiness]:
    rows = (
        Placement.objects.filter(revision_id__in=revision_ids)
        .values_list("revision_id", "state")
        .annotate(n=Count("id"))
    )
    result: dict[int, Readiness] = {}
    for revision_id, state, n in rows:
        r = result.setdefault(revision_id, Readiness())
        if state == PlacementState.READY:
            r.ready += n
        elif state in IN_FLIGHT:
            r.in_flight.append(state)
        elif state == PlacementState.FAILED:
            r.failed += n
    return result


@dataclass
class AdapterRow:
    adapter: Adapter
    live: AdapterRevision | None
    desired: AdapterRevision | None
    readiness: Readiness
    pending: int
    activation: serving_selectors.ActivationStatus | None = None  # why production has not flipped yet

    @property
    def state(self) -> str:
        """One word for the adapter filter: flipping (an activation pending), serving, or inactive."""
        if self.desired is not None and self.desired != self.live:
            return "flipping"
        return "serving" if self.live is not None else "inactive"


@dataclass
class AdapterPage:
    """One page of the overview, newest first (as the API lists them): its rows, and the ids the neighbouring pages
    start below or above (None where there is no such page). An id is the cursor: `(tenant, id)` is an index, so a
    page is read from any id on, at any depth."""

    rows: list[AdapterRow]
    after: int | None  # the next (older) page: ids below this one
    before: int | None  # the previous (newer) page: ids above this one


def _in_state(adapters: QuerySet[Adapter], state: str) -> QuerySet[Adapter]:
    """`adapters` in one of the overview's states (AdapterRow.state), in SQL, so a page of them is read at once.

    `serving`: production serves a revision (an activation may be pending too); `flipping`: production wants a
    revision it does not serve yet; `inactive`: production serves and wants nothing; `awaiting`: a revision waits
    for a decision.
    """
    production = Alias.objects.filter(adapter=OuterRef("pk"), name=Alias.PRODUCTION)
    if state == "serving":
        return adapters.filter(Exists(production.filter(revision__isnull=False)))
    if state == "flipping":
        wanted = production.filter(desired_revision__isnull=False)
        return adapters.filter(Exists(wanted.filter(Q(revision__isnull=True) | ~Q(revision=F("desired_revision")))))
    if state == "inactive":
        return adapters.exclude(
            Exists(production.filter(Q(revision__isnull=False) | Q(desired_revision__isnull=False)))
        )
    if state == "awaiting":
        pending = AdapterRevision.objects.filter(adapter=OuterRef("pk"), state=RevisionState.PENDING_APPROVAL)
        return adapters.filter(Exists(pending))
    return adapters


def adapter_page(
    *,
    tenant: Tenant,
    q: str = "",
    state: str = "",
    after: int | None = None,
    before: int | None = None,
    size: int = PAGE_SIZE,
) -> AdapterPage:
    """A page of the tenant's adapters, newest first, with their `production` alias, desired revision and its
    readiness (3 queries, however many adapters the tenant has).

    `q` keeps names that match it (adapters.selectors.adapter_search); `state` one state (`_in_state`). `after` is
    the page of the adapters older than that id, `before` of those newer; neither: the first page.
    """
    adapters = _in_state(adapter_selectors.adapter_list(tenant=tenant, q=q), state)
    if before:
        window = adapters.filter(id__gt=before).order_by("id")
    else:
        window = (adapters.filter(id__lt=after) if after else adapters).order_by("-id")
    # Counted for the page's rows only (a subquery per row shown), not grouped over every adapter of the tenant.
    pending = (
        AdapterRevision.objects.filter(adapter=OuterRef("pk"), state=RevisionState.PENDING_APPROVAL)
        .order_by()
        .values("adapter")
        .annotate(n=Count("id"))
        .values("n")
    )
    window = serving_selectors.with_aliases(window).annotate(pending=Coalesce(Subquery(pending), 0))
    found = list(window[: size + 1])
    more, found = len(found) > size, found[:size]
    if before:
        found.reverse()
    has_previous, has_next = (more, True) if before else (bool(after), more)
    return AdapterPage(
        rows=_adapter_rows(tenant, found),
        after=found[-1].id if found and has_next else None,
        before=found[0].id if found and has_previous else None,
    )


def _adapter_rows(tenant: Tenant, adapters: list[Adapter]) -> list[AdapterRow]:
    """The overview's rows of a page of adapters (aliases prefetched): readiness in one query for the page."""
    wanted: list[int] = []
    aliases = {}
    for adapter in adapters:
        adapter.tenant = tenant  # read by activation_status, without a query per adapter
        alias = next((a for a in adapter.aliases.all() if a.name == Alias.PRODUCTION), None)
        aliases[adapter.id] = alias
        if alias is not None:
            wanted += [i for i in (alias.revision_id, alias.desired_revision_id) if i]
    readiness = _readiness(wanted)
    rows = []
    explained = 0  # pending activations explained on this page so far (each costs a few queries)
    for adapter in adapters:
        alias = aliases[adapter.id]
        live = alias.revision if alias else None
        desired = alias.desired_revision if alias else None
        focus = desired or live
        # No query for an alias with nothing pending; a few for one that waits, for the first
        # OVERVIEW_EXPLAINED of them (the rest show "pending flip"; their adapter's page says why).
        activation = None
        if alias is not None and alias.desired_revision_id != alias.revision_id and explained < OVERVIEW_EXPLAINED:
            activation = serving_selectors.activation_status(alias)
            explained += 1
        rows.append(
            AdapterRow(
                adapter=adapter,
                live=live,
                desired=desired,
                readiness=readiness.get(focus.id, Readiness()) if focus else Readiness(),
                pending=adapter.pending,
                activation=activation,
            )
        )
    return rows
