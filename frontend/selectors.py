"""Reads for the dashboard pages. Every function takes the tenant, so nothing of another tenant is ever loaded.

Each page's queries are fixed in number, whatever the number of rows (the view tests pin them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.core.paginator import Page, Paginator
from django.db.models import Count, Prefetch, Q, QuerySet
from django.utils import timezone

from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision, Approval, BaseModel
from serving import selectors as serving_selectors
from serving.models import ACTIVE_STATES, HOLDING_STATES, Alias, Placement, PlacementState, ServingNode
from tenants import selectors as tenant_selectors
from tenants.models import ApiKey, AuditEvent, Tenant

PAGE_SIZE = 50
ACTIVE_WINDOW = timedelta(seconds=60)  # a ready adapter used this recently counts as active (in the GPU batch)
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


def page(queryset: QuerySet, number: str | int | None, *, size: int = PAGE_SIZE) -> Page:
    return Paginator(queryset, size).get_page(number)


# ---------------------------------------------------------------- overview


@dataclass
class AdapterRow:
    adapter: Adapter
    live: AdapterRevision | None
    desired: AdapterRevision | None
    readiness: Readiness
    pending: int


def adapter_rows(*, tenant: Tenant) -> list[AdapterRow]:
    """The tenant's adapters with their `production` alias, desired revision and its readiness (4 queries)."""
    adapters = list(
        serving_selectors.with_aliases(adapter_selectors.adapter_list(tenant=tenant))
        .annotate(pending=Count("revisions", filter=Q(revisions__state="pending_approval")))
        .order_by("name")
    )
    wanted: list[int] = []
    aliases = {}
    for adapter in adapters:
        alias = next((a for a in adapter.aliases.all() if a.name == Alias.PRODUCTION), None)
        aliases[adapter.id] = alias
        if alias is not None:
            wanted += [i for i in (alias.revision_id, alias.desired_revision_id) if i]
    readiness = _readiness(wanted)
    rows = []
    for adapter in adapters:
        alias = aliases[adapter.id]
        live = alias.revision if alias else None
        desired = alias.desired_revision if alias else None
        focus = desired or live
        rows.append(
            AdapterRow(
                adapter=adapter,
                live=live,
                desired=desired,
                readiness=readiness.get(focus.id, Readiness()) if focus else Readiness(),
                pending=adapter.pending,
            )
        )
    return rows


# ---------------------------------------------------------------- adapter detail


def adapter_get(*, tenant: Tenant, name: str) -> Adapter | None:
    """One adapter of the tenant, with its aliases (2 queries); None for a missing or another tenant's."""
    adapters = Adapter.objects.filter(tenant=tenant, name=name).select_related("tenant", "base_model")
    return serving_selectors.with_aliases(adapters, previous=True).first()


def revision_page(*, adapter: Adapter, number: str | int | None) -> Page:
    """A page of an adapter's revisions, newest first, with approvals and placements (4 queries)."""
    approvals = Approval.objects.select_related("decided_by", "decided_by_key").order_by("decided_at")
    placements = Placement.objects.select_related("node").order_by("node__name")
    revisions = (
        AdapterRevision.objects.filter(adapter=adapter)
        .select_related("created_by", "created_by_key", "parent")
        .prefetch_related(Prefetch("approvals", queryset=approvals), Prefetch("placements", queryset=placements))
        .order_by("-number")
    )
    return page(revisions, number, size=20)


def revision_get(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    placements = Placement.objects.select_related("node").order_by("node__name")
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .select_related("adapter__tenant", "created_by", "created_by_key")
        .prefetch_related(Prefetch("placements", queryset=placements))
        .first()
    )


# ---------------------------------------------------------------- nodes


@dataclass
class NodeRow:
    node: ServingNode
    holding: int
    ready: int
    active: int
    queued: int
    loading: int
    own: list[Placement]  # the viewing tenant's placements on this node (none for a platform-only view)

    @property
    def cpu_percent(self) -> int:
        return min(100, round(100 * self.holding / self.node.cpu_slots)) if self.node.cpu_slots else 0

    @property
    def gpu_percent(self) -> int:
        return min(100, round(100 * self.active / self.node.gpu_slots)) if self.node.gpu_slots else 0


def node_rows(*, tenant: Tenant | None, platform: bool = False) -> list[NodeRow]:
    """Nodes with their three tiers: all of them for staff (`platform`), else those serving the tenant's base models.

    Counts cover every tenant (they are capacity, not names); the placements listed are the tenant's own (2 queries).
    """
    recent = timezone.now() - ACTIVE_WINDOW
    nodes = ServingNode.objects.select_related("base_model").annotate(
        holding=Count("placements", filter=Q(placements__state__in=HOLDING_STATES)),
        ready=Count("placements", filter=Q(placements__state=PlacementState.READY)),
        active=Count(
            "placements", filter=Q(placements__state=PlacementState.READY, placements__last_used_at__gte=recent)
        ),
        queued=Count("placements", filter=Q(placements__state=PlacementState.QUEUED)),
        loading=Count("placements", filter=Q(placements__state__in=ACTIVE_STATES)),
    )
    if not platform:
        if tenant is None:
            return []
        # A subquery, not a join: a join through adapters would multiply the counts.
        nodes = nodes.filter(base_model__in=BaseModel.objects.filter(adapters__tenant=tenant).values("id"))
    nodes = list(nodes.order_by("name"))
    own: dict[int, list[Placement]] = {}
    if tenant is not None and nodes:
        for placement in (
            Placement.objects.filter(node__in=nodes, revision__adapter__tenant=tenant)
            .select_related("revision__adapter")
            .order_by("revision__adapter__name", "-revision__number")
        ):
            own.setdefault(placement.node_id, []).append(placement)
    return [
        NodeRow(
            node=n,
            holding=n.holding,
            ready=n.ready,
            active=n.active,
            queued=n.queued,
            loading=n.loading,
            own=own.get(n.id, []),
        )
        for n in nodes
    ]


# ---------------------------------------------------------------- audit and keys


def audit_page(
    *, tenant: Tenant, action: str = "", target: str = "", actor: str = "", number: str | int | None = None
) -> Page:
    """A page of the tenant's audit log, newest first (2 queries: count and rows)."""
    events: QuerySet[AuditEvent] = tenant_selectors.audit_event_list(tenant=tenant, action=action or None)
    if target:
        events = events.filter(target__icontains=target)
    if actor:
        events = events.filter(actor__icontains=actor)
    return page(events.order_by("-id"), number)


def audit_actions(*, tenant: Tenant) -> list[str]:
    return list(AuditEvent.objects.filter(tenant=tenant).order_by("action").values_list("action", flat=True).distinct())


def api_key_page(*, tenant: Tenant, number: str | int | None = None) -> Page:
    keys: QuerySet[ApiKey] = tenant_selectors.api_key_list(tenant=tenant).order_by("-id")
    return page(keys, number)


def api_key_get(*, tenant: Tenant, prefix: str) -> ApiKey | None:
    return tenant_selectors.api_key_list(tenant=tenant).select_related("tenant").filter(prefix=prefix).first()
