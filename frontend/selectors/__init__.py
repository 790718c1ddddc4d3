"""Reads for the dashboard pages. Every function takes the tenant, so nothing of another tenant is ever loaded.

Each page's queries are fixed in number, whatever the number of rows (the view tests pin them). The usage page's
reads are in `frontend.selectors.usage`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta

from django.core.paginator import Page, Paginator
from django.db.models import (
    Avg,
    Case,
    Count,
    Exists,
    F,
    IntegerField,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce
from django.utils import timezone

from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision, Approval, Evaluation, EvaluationSuite, RevisionState
from serving import selectors as serving_selectors
from serving.models import ACTIVE_STATES, HOLDING_STATES, Alias, NodeCopy, Placement, PlacementState, ServingNode
from serving.selectors import residency as residency_selectors
from serving.services import canary as serving_canary  # a canary's counters, read from Redis
from tenants import selectors as tenant_selectors
from tenants.models import ApiKey, AuditEvent, Tenant

PAGE_SIZE = 50
REVISION_PAGE_SIZE = 20
# The overview explains at most this many pending activations (a few queries each); the others link to their page.
OVERVIEW_EXPLAINED = 10
AUDIT_EXPORT_MAX_ROWS = 50_000  # one CSV export at most; the page says so, and a narrower date range gets the rest
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


# ---------------------------------------------------------------- adapter detail


def adapter_get(*, tenant: Tenant, name: str) -> Adapter | None:
    """One adapter of the tenant, with its aliases (2 queries); None for a missing or another tenant's."""
    adapters = Adapter.objects.filter(tenant=tenant, name=name).select_related("tenant", "base_model")
    return serving_selectors.with_aliases(adapters, previous=True).first()


_DIGITS = re.compile(r"(\d+)")


def alias_order(name: str) -> tuple:
    """Sort key for alias names: production first, then natural order (a2 before a10)."""
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p.lower()) for p in _DIGITS.split(name) if p)
    return (name != Alias.PRODUCTION, parts)


def aliases_of(adapter: Adapter) -> list[Alias]:
    """The adapter's prefetched aliases (`adapter_get`), production first, then in natural order, each with
    `activation`: why it has not flipped to its desired revision yet (None when nothing is pending)."""
    aliases = sorted(adapter.aliases.all(), key=lambda a: alias_order(a.name))
    for alias in aliases:
        alias.activation = serving_selectors.activation_status(alias)
        alias.canary_counts = serving_canary.canary_counts(alias=alias) if alias.canary_revision_id else None
    return aliases


def activation_warning(*, adapter: Adapter, revision: AdapterRevision) -> str | None:
    """What to know before activating `revision` (no room on the nodes, quota full), or None."""
    return serving_selectors.activation_room(adapter, revision)


def newest_suite(adapter: Adapter, *, cases: bool = False) -> EvaluationSuite | None:
    """The suite the gate and the runner use, without its cases (the page shows its size and who sent it) unless
    `cases` (a revision's own page shows the prompt and reference of each failing case)."""
    suites = EvaluationSuite.objects.filter(adapter=adapter)
    if not cases:
        suites = suites.defer("cases")
    return suites.select_related("created_by", "created_by_key").order_by("-version").first()


def revision_page(
    *,
    adapter: Adapter,
    number: str | int | None,
    state: str = "",
    only: int | None = None,
    suite: EvaluationSuite | None = None,
) -> Page:
    """A page of an adapter's revisions with approvals, placements and, with `suite`, each one's evaluation on
    it as `rev.shown_evaluations` (4 queries, 5 with a suite; per-case results only for one revision's page).

    Live and desired revisions (of any alias) come first, then the newest. `state` keeps one state;
    `only` keeps one revision number (the revision's own page).
    """
    approvals = Approval.objects.select_related("decided_by", "decided_by_key").order_by("decided_at")
    placements = Placement.objects.select_related("node").order_by("node__name")
    prefetches = [Prefetch("approvals", queryset=approvals), Prefetch("placements", queryset=placements)]
    if suite is not None:
        evaluations = Evaluation.objects.filter(suite=suite).select_related("baseline_revision")
        if only is None:
            evaluations = evaluations.defer("case_results", "runner")
        prefetches.append(Prefetch("evaluations", queryset=evaluations, to_attr="shown_evaluations"))
    live = [a.revision_id for a in adapter.aliases.all() if a.revision_id]
    desired = [a.desired_revision_id for a in adapter.aliases.all() if a.desired_revision_id]
    revisions = AdapterRevision.objects.filter(adapter=adapter)
    if state:
        revisions = revisions.filter(state=state)
    if only is not None:
        revisions = revisions.filter(number=only)
    revisions = (
        revisions.select_related("created_by", "created_by_key", "parent")
        .prefetch_related(*prefetches)
        .annotate(
            rank_first=Case(
                When(id__in=live or [0], then=Value(0)),
                When(id__in=desired or [0], then=Value(1)),
                default=Value(2),
                output_field=IntegerField(),
            )
        )
        .order_by("rank_first", "-number")
    )
    return page(revisions, number, size=REVISION_PAGE_SIZE)


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


# ---------------------------------------------------------------- audit and keys


def audit_events(
    *,
    tenant: Tenant,
    action: str = "",
    target: str = "",
    actor: str = "",
    since: date | None = None,
    until: date | None = None,
) -> QuerySet[AuditEvent]:
    """The tenant's audit events matching the filters, newest first; `since`/`until` are UTC days, both included."""
    events: QuerySet[AuditEvent] = tenant_selectors.audit_event_list(tenant=tenant, action=action or None)
    if target:
        events = events.filter(target__icontains=target)
    if actor:
        events = events.filter(actor__icontains=actor)
    if since:
        events = events.filter(at__gte=datetime.combine(since, time.min, tzinfo=UTC))
    if until and until < date.max:  # the last representable day bounds nothing (and has no day after it)
        events = events.filter(at__lt=datetime.combine(until + timedelta(days=1), time.min, tzinfo=UTC))
    return events.order_by("-id")


def audit_page(*, tenant: Tenant, number: str | int | None = None, **filters) -> Page:
    """A page of the tenant's audit log, newest first (2 queries: count and rows)."""
    return page(audit_events(tenant=tenant, **filters), number)


def audit_export_rows(*, tenant: Tenant, **filters) -> Iterator[AuditEvent]:
    """The tenant's matching audit events for a CSV export, newest first, at most AUDIT_EXPORT_MAX_ROWS,
    read from the database in chunks (the export streams them)."""
    events = audit_events(tenant=tenant, **filters)[:AUDIT_EXPORT_MAX_ROWS]
    return events.iterator(chunk_size=2000)


def audit_actions(*, tenant: Tenant) -> list[str]:
    return list(AuditEvent.objects.filter(tenant=tenant).order_by("action").values_list("action", flat=True).distinct())


def api_key_page(*, tenant: Tenant, number: str | int | None = None) -> Page:
    keys: QuerySet[ApiKey] = tenant_selectors.api_key_list(tenant=tenant).order_by("-id")
    return page(keys, number)


def api_key_get(*, tenant: Tenant, prefix: str) -> ApiKey | None:
    return tenant_selectors.api_key_list(tenant=tenant).select_related("tenant").filter(prefix=prefix).first()
