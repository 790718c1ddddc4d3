"""The nodes page: every serving node with its tiers, and what of the viewing tenant's it holds."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Avg, Count, Exists, OuterRef, Q, Sum
from django.utils import timezone

from adapters.models import Adapter
from serving.models import ACTIVE_STATES, HOLDING_STATES, NodeCopy, Placement, PlacementState, ServingNode
from serving.selectors import residency as residency_selectors
from tenants.models import Tenant

ACTIVE_WINDOW = timedelta(seconds=60)  # a ready adapter used this recently counts as active (in the GPU batch)


@dataclass
class NodeRow:
    node: ServingNode
    holding: int
    ready: int
    active: int
    queued: int
    loading: int
    own: list[Placement]  # the viewing tenant's placements on this node (none for a platform-only view)
    load_ms: float | None = None  # mean phase-1 (fetch, verify, load) time of the node's placements, every tenant's
    warm_ms: float | None = None  # mean phase-2 (warm-up completion) time
    disk_bytes: int = 0  # the node's disk tier: bytes of the exports it keeps (serving.models.NodeCopy)
    chart: dict | None = None  # its residency per minute (serving.selectors.residency.node_series)

    @property
    def cpu_percent(self) -> int:
        return min(100, round(100 * self.holding / self.node.cpu_slots)) if self.node.cpu_slots else 0

    @property
    def gpu_percent(self) -> int:
        return min(100, round(100 * self.active / self.node.gpu_slots)) if self.node.gpu_slots else 0


def node_rows(*, tenant: Tenant | None, platform: bool = False) -> list[NodeRow]:
    """Nodes with their three tiers: all of them for staff (`platform`), else those serving the tenant's base models.

    Counts and mean load and warm times cover every tenant (they are capacity, not names); the placements listed
    are the tenant's own (2 queries).
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
        load_ms_avg=Avg("placements__load_ms"),  # NULL (not loaded yet) is left out of the mean
        warm_ms_avg=Avg("placements__warm_ms"),
    )
    if not platform:
        if tenant is None:
            return []
        # A subquery, not a join: a join through adapters would multiply the counts. One probe of the adapters'
        # (tenant, base_model) index per node, not a read of every adapter of a tenant that has 10^5 of them.
        nodes = nodes.filter(Exists(Adapter.objects.filter(tenant=tenant, base_model=OuterRef("base_model"))))
    nodes = list(nodes.order_by("name"))
    own: dict[int, list[Placement]] = {}
    if tenant is not None and nodes:
        for placement in (
            Placement.objects.filter(node__in=nodes, revision__adapter__tenant=tenant)
            .select_related("revision__adapter")
            .order_by("revision__adapter__name", "-revision__number")
        ):
            own.setdefault(placement.node_id, []).append(placement)
    disk = dict(
        NodeCopy.objects.filter(node__in=nodes)
        .values("node_id")
        .annotate(b=Sum("size_bytes"))
        .values_list("node_id", "b")
    )
    charts = residency_selectors.node_series([n.name for n in nodes]) if nodes else {}
    return [
        NodeRow(
            node=n,
            holding=n.holding,
            ready=n.ready,
            active=n.active,
            queued=n.queued,
            loading=n.loading,
            own=own.get(n.id, []),
            load_ms=n.load_ms_avg,
            warm_ms=n.warm_ms_avg,
            disk_bytes=disk.get(n.id) or 0,
            chart=charts.get(n.name),
        )
        for n in nodes
    ]


def fleet_misses() -> dict | None:
    """Requests for revisions loaded nowhere, per minute (no node answered them: a load on demand was asked)."""
    from serving.residency.stats import FLEET

    return residency_selectors.node_series([]).get(FLEET)
